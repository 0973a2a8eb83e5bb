// A chat template's text (model/chat_template.h), any bytes: it parses or
// is refused with kvq::Error, and what parses renders three conversations
// (none, one turn, several with Unicode, tools and a list of parts) under
// small bounds, each to a prompt or a kvq::Error. A render that loops past
// its step bound, allocates past its work bound or crashes is a finding.
#include <cstddef>
#include <cstdint>
#include <string>

#include "kvq/error.h"
#include "model/chat_template.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using nlohmann::ordered_json;
  static const ordered_json kConversations[] = {
      ordered_json::array(),
      ordered_json::parse(R"([{"role": "user", "content": "Hello"}])"),
      ordered_json::parse(R"([{"role": "system", "content": "Be brief. \u00e9\u2028"},
                             {"role": "user", "content": [{"type": "text", "text": "parts"}]},
                             {"role": "assistant", "content": "<think>\nx\n</think>\n\nok",
                              "tool_calls": [{"function": {"name": "f", "arguments": {"a": [1, 2.5, null]}}}]},
                             {"role": "tool", "content": "{}"}, {"role": "user", "content": "  again 🙂 "}])")};
  kvq::model::ChatTemplateLimits lim;
  lim.max_steps = 200'000;
  lim.max_work_bytes = 8u << 20;
  lim.max_output_bytes = 1u << 20;
  lim.max_depth = 64;
  try {
    const kvq::model::ChatTemplate t(std::string(reinterpret_cast<const char*>(data), size), "fuzz", lim);
    for (const auto& m : kConversations) {
      kvq::model::ChatTemplateInput in;
      in.messages = m;
      in.bos_token = "<s>";
      in.eos_token = "</s>";
      in.extra = ordered_json::parse(R"({"tools": [{"type": "function", "function": {"name": "f"}}]})");
      try {
        const std::string out = t.render(in);
        if (out.size() > lim.max_output_bytes) __builtin_trap();
      } catch (const kvq::Error&) {
      }
    }
  } catch (const kvq::Error&) {
  }
  return 0;
}
