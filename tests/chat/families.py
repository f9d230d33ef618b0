"""Real chat templates of model families (TRL ships their Jinja text) on offline byte-level BPE tokenizers.

There is no model hub here, so each family's tokenizer is trained in memory with that family's special tokens;
TRL's ``add_response_schema`` then attaches the family's response template.
"""

from pathlib import Path

import trl
from trl.chat_template_utils import add_response_schema

from trajlab.models.offline_tokenizer import build_offline_tokenizer

TEMPLATES = Path(trl.__file__).parent / "chat_templates"
CHATML = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
LLAMA = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
         "<|python_tag|>", "<|finetune_right_pad_id|>"]
FAMILIES = {  # name: (template file, special tokens, eos, bos, end-of-turn texts the model emits)
    "qwen2_5": ("qwen2_5.jinja", CHATML, "<|im_end|>", None, ("<|im_end|>",)),
    "qwen3": ("qwen3.jinja", CHATML, "<|im_end|>", None, ("<|im_end|>",)),
    "llama3_1": ("llama3_1.jinja", LLAMA, "<|eot_id|>", "<|begin_of_text|>", ("<|eot_id|>", "<|eom_id|>")),
}
CORPUS = ['Look up apple and pear. lookup word fruit <tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Paris"}} parameters Done.'] * 50


def family_tokenizer(name: str, template: str | None = None):
    """The family's tokenizer; ``template`` replaces its chat template text (e.g. an edited copy)."""
    filename, special, eos, bos, _ = FAMILIES[name]
    tokenizer = build_offline_tokenizer(template or (TEMPLATES / filename).read_text(), special, eos_token=eos,
                                        bos_token=bos, vocab_size=600, corpus=CORPUS)
    return add_response_schema(tokenizer) if template is None else tokenizer
