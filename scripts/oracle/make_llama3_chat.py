"""Reference renderings of the real Llama 3.1, 3.2 and 3.3 Instruct chat templates by transformers.

The templates are Meta's, as llama.cpp keeps copies of them (models/templates/meta-llama-*.jinja in
the llama-cpp-python 0.3.36 sdist; see make_gguf.py for fetching it). transformers renders each case
as apply_chat_template does (its jinja environment, bos/eos strings of the Llama 3 Instruct
tokenizers); the date is passed as `date_string` wherever a template would otherwise stamp today's.

    LLAMA_CPP_DIR=/tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp \
        python3 scripts/oracle/make_llama3_chat.py tests/fixtures/llama3_chat
"""
import json, os, shutil, sys
import transformers
from transformers.utils.chat_template_utils import render_jinja_template

out = sys.argv[1]
templates_dir = os.path.join(os.environ["LLAMA_CPP_DIR"], "models", "templates")
TEMPLATES = ["meta-llama-Llama-3.1-8B-Instruct.jinja", "meta-llama-Llama-3.2-3B-Instruct.jinja",
             "meta-llama-Llama-3.3-70B-Instruct.jinja"]
SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
DATE = {"date_string": "06 Dec 2026"}

weather = {"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                          "required": ["city"]}}}
round_trip = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
              {"role": "tool", "content": "{\"temp\": 21, \"unit\": \"c\"}"}]
cases = [
    {"name": "plain", "messages": [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hello!\n"}], "kwargs": DATE},
    {"name": "user_only", "messages": [{"role": "user", "content": "What is 2+2?"}], "kwargs": DATE},
    {"name": "multi_turn", "kwargs": DATE,
     "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
                  {"role": "user", "content": "Tell me a joke."}]},
    {"name": "tools_in_user_message", "messages": [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"}],
     "tools": [weather], "kwargs": DATE},
    {"name": "tools_in_system_message", "messages": [{"role": "user", "content": "Weather in Paris?"}],
     "tools": [weather], "kwargs": dict(DATE, tools_in_user_message=False)},
    {"name": "tool_round_trip", "messages": round_trip, "tools": [weather], "kwargs": DATE},
    {"name": "builtin_tools", "messages": [{"role": "user", "content": "Search the news."}],
     "kwargs": dict(DATE, builtin_tools=["brave_search", "wolfram_alpha"])},
    {"name": "default_date", "messages": [{"role": "user", "content": "Hello"}], "kwargs": {}},
]
results = []
for name in TEMPLATES:
    shutil.copy(os.path.join(templates_dir, name), out)
    source = open(os.path.join(templates_dir, name)).read()
    for case in cases:
        # 3.2 stamps today's date without a date_string: that render is not reproducible.
        if case["name"] == "default_date" and "strftime_now" in source:
            continue
        rendered, _ = render_jinja_template(conversations=[case["messages"]], tools=case.get("tools"), chat_template=source,
                                            add_generation_prompt=True, **SPECIAL, **case["kwargs"])
        results.append(dict(case, template=name, rendered=rendered[0]))
json.dump({"source": f"transformers {transformers.__version__} render_jinja_template (what apply_chat_template calls), "
                     "add_generation_prompt=True, bos/eos of the Llama 3 Instruct tokenizers",
           "special": SPECIAL, "cases": results}, open(os.path.join(out, "expected.json"), "w"), indent=1)
print([(r["template"][11:20], r["name"], len(r["rendered"])) for r in results])
