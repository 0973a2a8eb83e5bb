// llama.cpp's own multi-sequence decode through node-llama-cpp: one context with C sequences, each
// given its prompt (token ids) and run greedily for N tokens, all at once; node-llama-cpp puts the
// sequences' tokens of each step in one llama_batch (one llama_decode a step).
// Prints {"seconds", "tokens", "outputs"} (outputs: each sequence's generated ids).
// Usage: node llama_cpp_batch.mjs MODEL PROMPTS.json N KV_TYPE THREADS
import {getLlama} from "node-llama-cpp";
import fs from "node:fs";
const [modelPath, promptsPath, nS, kvType, threadsS] = process.argv.slice(2);
const prompts = JSON.parse(fs.readFileSync(promptsPath, "utf8"));
const N = +nS, C = prompts.length;
const longest = Math.max(...prompts.map((p) => p.length));
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath});
const context = await model.createContext({
  contextSize: C * (longest + N + 16), sequences: C, batchSize: 512, threads: +threadsS,
  flashAttention: kvType !== "F16" && kvType !== "F32",
  experimentalKvCacheKeyType: kvType, experimentalKvCacheValueType: kvType});
const seqs = prompts.map(() => context.getSequence());
const t0 = performance.now();
const outputs = await Promise.all(seqs.map(async (seq, i) => {
  const out = [];
  for await (const t of seq.evaluate(prompts[i], {temperature: 0})) {
    out.push(t);
    if (out.length >= N) break;
  }
  return out;
}));
const seconds = (performance.now() - t0) / 1000;
console.log(JSON.stringify({seconds, tokens: outputs.reduce((a, o) => a + o.length, 0), outputs}));
