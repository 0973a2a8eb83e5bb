// llama.cpp's perplexity recipe through node-llama-cpp: chunks of ctx ids with BOS first, the second
// half scored. Prints {"ppl", "n"}. Usage: node lp.mjs MODEL IDS.json CTX CHUNKS KV_TYPE [PROBS.f32 VOCAB]
// With PROBS.f32: every scored position's whole distribution (VOCAB float32 probabilities a row), for
// KL divergences between runs.
import {getLlama} from "node-llama-cpp";
import fs from "node:fs";
const [modelPath, idsPath, ctxS, chunksS, kvType, probsPath, vocabS] = process.argv.slice(2);
const ctx = +ctxS, chunks = +chunksS;
const ids = JSON.parse(fs.readFileSync(idsPath, "utf8"));
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath});
const context = await model.createContext({contextSize: ctx + 256, batchSize: ctx, threads: 1,
    flashAttention: kvType !== "F16" && kvType !== "F32",
    experimentalKvCacheKeyType: kvType, experimentalKvCacheValueType: kvType});
const seq = context.getSequence();
const nll = [];
const rows = [];
for (let c = 0; c < chunks; c++) {
  await seq.clearHistory();
  const chunk = ids.slice(c * ctx, (c + 1) * ctx);
  chunk[0] = ids[0];
  const input = chunk.map((t, i) => (i >= ctx / 2 && i < ctx - 1) ? [t, {generateNext: {probabilities: true}}] : t);
  const out = await seq.controlledEvaluate(input);
  for (let i = ctx / 2; i < ctx - 1; i++) {
    const p = out[i].next.probabilities;
    nll.push(-Math.log(p.get(chunk[i + 1]) ?? 0));
    if (probsPath) {
      const row = new Float32Array(+vocabS);
      for (const [t, v] of p) if (t < row.length) row[t] = v;
      rows.push(row);
    }
  }
}
if (probsPath) {
  const all = new Float32Array(rows.length * +vocabS);
  rows.forEach((r, k) => all.set(r, k * +vocabS));
  fs.writeFileSync(probsPath, Buffer.from(all.buffer));
}
const mean = nll.reduce((a, b) => a + b, 0) / nll.length;
console.log(JSON.stringify({ppl: Math.exp(mean), n: nll.length}));
