// kvq serve through OpenAI's official Node client (npm `openai`, pinned in
// scripts/install_deps.sh): models.list, a completion, the same streamed, an
// error. Prints one JSON object; tests/serve_test.py compares it with what
// the standard-library client got.
//   node tests/openai_client.mjs ORACLES_DIR BASE_URL PROMPT MAX_TOKENS
import { createRequire } from "node:module";

const [oracles, baseURL, prompt, maxTokens] = process.argv.slice(2);
const require = createRequire(oracles + "/");
const OpenAI = require("openai");
const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0 });

const out = {};
const models = await client.models.list();
out.models = models.data.map((m) => m.id);
const model = out.models[0];
const body = { model, prompt, max_tokens: Number(maxTokens), temperature: 0 };
const c = await client.completions.create(body);
out.text = c.choices[0].text;
out.finish_reason = c.choices[0].finish_reason;
out.usage = c.usage;
let streamed = "";
let finish = null;
const stream = await client.completions.create({ ...body, stream: true });
for await (const chunk of stream) {
  if (chunk.choices.length) {
    streamed += chunk.choices[0].text;
    if (chunk.choices[0].finish_reason) finish = chunk.choices[0].finish_reason;
  }
}
out.streamed = streamed;
out.stream_finish_reason = finish;
try {
  await client.completions.create({ ...body, max_tokens: -1 });
  out.error_status = 0;
} catch (e) {
  out.error_status = e.status;
  out.error_param = e.param ?? e.error?.param ?? null;
}
console.log(JSON.stringify(out));
