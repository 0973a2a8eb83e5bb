// A model's chat template (a GGUF's tokenizer.chat_template, Hugging Face's
// Jinja) rendered into the prompt of a conversation: the bounded Jinja subset
// chat templates use, in Hugging Face's environment (trim_blocks,
// lstrip_blocks, loop controls, raise_exception, a tojson that keeps
// non-ASCII characters), byte for byte what python3-jinja2 renders
// (tests/chat_template_test.py).
//
// The subset: text, {{ }}, {% %} and {# #} with whitespace control (- and +);
// if / elif / else, for (tuple targets, an `if` filter, else, loop.index,
// index0, revindex, revindex0, first, last, length, previtem, nextitem),
// break, continue, set (names, namespace attributes, tuples, blocks), raw,
// generation; literals (strings with Python's escapes, integers, floats,
// lists, dicts, tuples, true / false / none); + - * / // % ** ~, comparisons,
// in / not in, and / or / not, a if c else b; subscripts, slices, attributes;
// filters (trim, length, count, first, last, join, default, upper, lower,
// title, capitalize, replace, string, int, float, abs, list, reverse, tojson,
// items, selectattr, rejectattr, map(attribute=), unique, sort); tests
// (defined, undefined, none, string, number, integer, float, boolean,
// mapping, iterable, sequence, true, false, odd, even, divisibleby,
// equalto / eq / ==, ne, in, lower, upper); string, dict and list methods
// (strip, lstrip, rstrip, split, startswith, endswith, upper, lower, title,
// capitalize, replace, find, count, items, keys, values, get); globals
// raise_exception, namespace, range, strftime_now. Macros, call blocks,
// includes and filter blocks are refused when the template is parsed.
//
// Every render is bounded (ChatTemplateLimits): evaluation steps, bytes of
// every string made, output bytes, range and loop lengths, nesting; past a
// bound it throws kvq::Error. Nothing a template does loops forever or
// allocates without limit (fuzz/fuzz_chat_template.cc).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace kvq::model {

struct ChatTemplateLimits {
  uint64_t max_steps = 4'000'000;       // expression and statement evaluations
  uint64_t max_work_bytes = 256u << 20;  // bytes of all the strings and lists a render makes
  uint64_t max_output_bytes = 64u << 20;
  int max_depth = 128;                   // nesting of expressions and blocks (parse and render)
};

struct ChatTemplateInput {
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();  // [{"role", "content", ...}]
  bool add_generation_prompt = true;
  std::string bos_token, eos_token;
  // Other variables the template sees (tools, enable_thinking, ...); an
  // object. Absent names are undefined.
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();
};

class ChatTemplate {
 public:
  // Parses `source`; `what` names it in errors ("the GGUF's
  // tokenizer.chat_template", "--chat-template FILE"). Throws kvq::Error
  // with the line and what was expected.
  ChatTemplate(const std::string& source, std::string what, ChatTemplateLimits limits = {});
  ~ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;

  // The prompt text. Throws kvq::Error: the template's raise_exception (its
  // message), an error of evaluation (an undefined value used, wrong types),
  // a bound passed.
  std::string render(const ChatTemplateInput& in) const;
  const std::string& what() const { return what_; }

  // Built-in templates, chosen by name (`--chat-template NAME`): llama3,
  // chatml, mistral, gemma, phi3, llama2. Null for another name.
  static const char* builtin(const std::string& name);
  static std::vector<std::string> builtin_names();
  // The family a template's text is recognised as (llama.cpp's way: by the
  // markers it contains), or "" when none: llama3, chatml, mistral, gemma,
  // phi3, llama2.
  static std::string family(const std::string& source);
  // The text that ends an assistant's turn in a family ("<|eot_id|>",
  // "<|im_end|>", "<end_of_turn>", "<|end|>"; "" for mistral and llama2,
  // whose turns end with EOS).
  static std::string end_of_turn(const std::string& family);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string what_;
};

class Tokenizer;

// A model's chat format: its template, the BOS / EOS text the template sees
// and what ends an assistant's turn (kvq serve's /v1/chat/completions, kvq
// chat-template).
struct ChatFormat {
  std::shared_ptr<const ChatTemplate> tmpl;  // null: the model has none (problem says so)
  std::string origin;       // "the GGUF's tokenizer.chat_template", "built-in chatml", "FILE"
  std::string source;       // the template's text
  std::string family;       // ChatTemplate::family(source), "" when not recognised
  std::string bos_text, eos_text;
  std::string end_of_turn;  // the text that ends a turn; "" when EOS does
  int end_of_turn_id = -1;  // its token when it is one token of the vocabulary
  std::string problem;      // with no template: why, and the fallbacks

  // The prompt's ids: the rendered text encoded by the model's rule (BOS
  // when the model adds one); a BOS the template wrote at the start is that
  // BOS, not text. Throws kvq::Error (the template's or the tokenizer's).
  std::vector<int> prompt_ids(const Tokenizer& tok, const std::string& text) const;
  std::string render(const nlohmann::ordered_json& messages, bool add_generation_prompt = true,
                     const nlohmann::ordered_json& extra = nlohmann::ordered_json::object()) const;
};

// The chat format of `model` (its tokenizer may be null) with the template
// `spec` names: "" the model's own (a GGUF's tokenizer.chat_template), a
// built-in's name (ChatTemplate::builtin_names), or a file of template text
// or a Hugging Face tokenizer_config.json ("chat_template": a string, or the
// "default" of a list). `option` names spec in errors ("--chat-template").
// A template given by `spec` that cannot be read, parsed or (with `probe`)
// render a one-message conversation throws kvq::Error; the model's own that
// cannot gives a format without a template whose problem says why, and how
// to choose another.
ChatFormat chat_format(const Tokenizer* tok, const std::string& model_template, const std::string& spec,
                       const std::string& option, bool probe = true);

}  // namespace kvq::model
