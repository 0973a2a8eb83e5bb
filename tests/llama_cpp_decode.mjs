// llama.cpp's own single-sequence prefill and decode through node-llama-cpp: a context of one
// sequence evaluates the prompt (token ids) and then runs greedily for N tokens. The first token comes
// out after the prompt's prefill (its logits are the prompt's last position's), each later one after
// one decode step, so prefill seconds = time to the first token, decode seconds = the rest.
// Prints {"prefill_seconds", "decode_seconds", "prompt", "generated", "ids", "cpu_variant"} (the
// libggml-cpu-*.so ggml loaded, read from /proc/self/maps).
// Usage: node llama_cpp_decode.mjs MODEL PROMPT.json N KV_TYPE THREADS
import {getLlama} from "node-llama-cpp";
import fs from "node:fs";
const [modelPath, promptPath, nS, kvType, threadsS] = process.argv.slice(2);
const prompt = JSON.parse(fs.readFileSync(promptPath, "utf8"));
const N = +nS;
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath});
const context = await model.createContext({
  contextSize: prompt.length + N + 16, sequences: 1, batchSize: 512, threads: +threadsS,
  flashAttention: kvType !== "F16" && kvType !== "F32",
  experimentalKvCacheKeyType: kvType, experimentalKvCacheValueType: kvType});
const seq = context.getSequence();
const ids = [];
const t0 = performance.now();
let first = 0;
for await (const t of seq.evaluate(prompt, {temperature: 0})) {
  if (ids.length === 0) first = performance.now();
  ids.push(t);
  if (ids.length >= N) break;
}
const end = performance.now();
const maps = fs.existsSync("/proc/self/maps") ? fs.readFileSync("/proc/self/maps", "utf8") : "";
const variant = [...new Set([...maps.matchAll(/libggml-cpu-([\w-]+)\.so/g)].map((m) => m[1]))].join(",");
console.log(JSON.stringify({prefill_seconds: (first - t0) / 1000, decode_seconds: (end - first) / 1000,
                            prompt: prompt.length, generated: ids.length, ids, cpu_variant: variant}));
