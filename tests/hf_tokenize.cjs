// Hugging Face's tokenizers (the Rust library, built for node: @anush008/tokenizers-linux-x64-gnu)
// as the reference of kvq's byte-level BPE. Usage: node hf_tokenize.cjs TOKENIZER.json TEXTS.json
// prints one JSON array: the ids of each text, without special tokens added.
const { Tokenizer } = require("@anush008/tokenizers-linux-x64-gnu");
const fs = require("node:fs");
const [tokPath, textsPath] = process.argv.slice(2);
const tok = Tokenizer.fromFile(tokPath);
const texts = JSON.parse(fs.readFileSync(textsPath, "utf8"));
(async () => {
  const out = [];
  for (const t of texts) out.push(Array.from((await tok.encode(t, null, { addSpecialTokens: false })).getIds()));
  process.stdout.write(JSON.stringify(out));
})();
