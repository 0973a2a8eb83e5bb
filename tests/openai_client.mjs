// kvq serve through OpenAI's official Node client (npm `openai`, pinned in
// scripts/install_deps.sh): models.list, a completion, the same streamed, an
// error; with MESSAGES (a JSON array), chat.completions.create the same
// ways. Prints one JSON object; tests/serve_test.py compares it with what
// the standard-library client got.
//   node tests/openai_client.mjs ORACLES_DIR BASE_URL PROMPT MAX_TOKENS [MESSAGES]
import { createRequire } from "node:module";

const [oracles, baseURL, prompt, maxTokens, messages] = process.argv.slice(2);
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
if (messages) {
  const chat = { model, messages: JSON.parse(messages), max_tokens: Number(maxTokens), temperature: 0 };
  const r = await client.chat.completions.create(chat);
  out.chat_text = r.choices[0].message.content;
  out.chat_role = r.choices[0].message.role;
  out.chat_finish_reason = r.choices[0].finish_reason;
  out.chat_usage = r.usage;
  out.chat_object = r.object;
  let text = "";
  let role = null;
  let chatFinish = null;
  let usage = null;
  const s = await client.chat.completions.create({ ...chat, stream: true, stream_options: { include_usage: true } });
  for await (const chunk of s) {
    if (chunk.usage) usage = chunk.usage;
    if (!chunk.choices.length) continue;
    const d = chunk.choices[0].delta;
    if (d.role) role = d.role;
    if (d.content) text += d.content;
    if (chunk.choices[0].finish_reason) chatFinish = chunk.choices[0].finish_reason;
  }
  out.chat_streamed = text;
  out.chat_stream_role = role;
  out.chat_stream_finish_reason = chatFinish;
  out.chat_stream_usage = usage;
  try {
    await client.chat.completions.create({ ...chat, tools: [{ type: "function", function: { name: "f" } }] });
    out.chat_error_status = 0;
  } catch (e) {
    out.chat_error_status = e.status;
    out.chat_error_param = e.param ?? e.error?.param ?? null;
  }
}
console.log(JSON.stringify(out));
