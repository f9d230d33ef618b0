"""The tiny offline vision-language model (trajlab.models.tiny_vision): build, load, images reaching the logits,
template with images in tool results."""

from __future__ import annotations

import json
import random
import shutil
import time
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from jinja2 import TemplateError
from PIL import Image
from safetensors.torch import load_file
from transformers import (
    AutoModelForImageTextToText,
    AutoProcessor,
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)
from transformers.utils.chat_template_utils import render_jinja_template
from trl.chat_template_utils import (
    has_generation_markers,
    is_chat_template_prefix_preserving,
    is_chat_template_stop_token_trained,
)

from trajlab.chat.template import resolve_chat_template
from trajlab.models.loading import load_model, load_processor, load_tokenizer
from trajlab.models.offline_tokenizer import build_offline_tokenizer
from trajlab.models.tiny import TINY_CHAT_TEMPLATE, TINY_RESPONSE_TEMPLATE
from trajlab.models.tiny_vision import (
    TINY_VL_CHAT_TEMPLATE,
    TINY_VL_IMAGE_TOKENS,
    TINY_VL_TOKENS_PER_IMAGE,
    init_tiny_vision_model,
)

BOI, IMAGE, EOI = (TINY_VL_IMAGE_TOKENS[k] for k in ("boi_token", "image_token", "eoi_token"))

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "screenshot",
            "description": "Take a screenshot.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "zoom",
            "description": "Zoom into a region.",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
        },
    },
]


def _image(seed: int, size: tuple[int, int] = (64, 64)) -> Image.Image:
    return Image.frombytes("RGB", size, random.Random(seed).randbytes(size[0] * size[1] * 3))


def _call(name: str, arguments: dict | str) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# Images of several sizes in the user turn and in tool results: one image, text around an image, a tool result
# without one, two images in one result, and the processor's {"type": "image", "image": ...} shape throughout.
A, B, C, D = _image(1), _image(2, (56, 56)), _image(3, (100, 30)), _image(4, (20, 80))
CONVERSATION = [
    {"role": "system", "content": "You look at screens."},
    {"role": "user", "content": [{"type": "text", "text": "What is on screen? "}, {"type": "image", "image": A}]},
    {"role": "assistant", "content": "", "tool_calls": [_call("screenshot", {})]},
    {"role": "tool", "name": "screenshot", "content": [{"type": "image", "image": B}]},
    {"role": "assistant", "content": "Two zooms.", "tool_calls": [_call("zoom", {"x": 1}), _call("zoom", '{"x": 2}')]},
    {"role": "tool", "name": "zoom", "content": [{"type": "text", "text": "zoomed: "}, {"type": "image", "image": C}]},
    {"role": "tool", "name": "zoom", "content": "no image this time"},
    {"role": "assistant", "content": "It is a chart."},
    {"role": "user", "content": [{"type": "image", "image": D}, {"type": "text", "text": " And this?"}]},
    {"role": "assistant", "content": None, "tool_calls": [_call("screenshot", {})]},
    {"role": "tool", "name": "screenshot", "content": [{"type": "image", "image": A}, {"type": "image", "image": B}]},
    {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
]


def _images(messages: list[dict]) -> list[Image.Image]:
    return [part["image"] for m in messages if isinstance(m["content"], list) for part in m["content"]
            if part["type"] == "image"]


def _text(processor, messages: list[dict], **kwargs) -> str:
    return processor.apply_chat_template(messages, tools=TOOLS, tokenize=False, **kwargs)


def _ids(processor, messages: list[dict], **kwargs) -> list[int]:
    images = _images(messages)
    out = processor(text=[_text(processor, messages, **kwargs)], images=[images] if images else None)
    return list(out["input_ids"][0])


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    out = tmp_path_factory.mktemp("tiny-vl") / "model"
    start = time.perf_counter()
    init_tiny_vision_model(out, seed=0)
    return out, time.perf_counter() - start


@pytest.fixture(scope="module")
def vl_dir(built: tuple[Path, float]) -> Path:
    return built[0]


@pytest.fixture(scope="module")
def processor(vl_dir: Path):
    return load_processor(vl_dir)


@pytest.fixture(scope="module")
def model(vl_dir: Path):
    return load_model(vl_dir)


def _inputs(processor, image: Image.Image, device: torch.device | str = "cpu") -> dict:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Describe "}, {"type": "image"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=[text], images=[[image]], return_tensors="pt").to(device)


# --- the model -------------------------------------------------------------------------------------------------------


def test_builds_offline_in_seconds(built: tuple[Path, float]) -> None:
    path, elapsed = built
    assert elapsed < 30
    for name in ("config.json", "model.safetensors", "generation_config.json", "processor_config.json",
                 "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (path / name).is_file(), name


def test_it_is_a_tiny_gemma3(model) -> None:
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    assert not model.training and model.dtype == torch.float32
    assert 1_000_000 <= sum(p.numel() for p in model.parameters()) <= 10_000_000
    text, vision = model.config.text_config, model.config.vision_config
    assert (text.hidden_size, text.num_hidden_layers) == (192, 4)
    assert "full_attention" in text.layer_types and "sliding_attention" in text.layer_types
    assert vision.num_hidden_layers == 2
    assert model.config.mm_tokens_per_image == TINY_VL_TOKENS_PER_IMAGE


def test_plain_transformers_loads_it_offline_and_the_ids_point_at_the_image_tokens(vl_dir: Path) -> None:
    processor = AutoProcessor.from_pretrained(vl_dir, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(vl_dir, local_files_only=True)
    tok = processor.tokenizer
    assert type(processor).__name__ == "Gemma3Processor"
    assert model.config.text_config.vocab_size == len(tok)
    for name, token in TINY_VL_IMAGE_TOKENS.items():
        assert getattr(tok, name) == token
        assert getattr(model.config, f"{name}_id") == getattr(tok, f"{name}_id") == tok.convert_tokens_to_ids(token)
        assert token in tok.all_special_tokens
        assert len(tok.encode(token, add_special_tokens=False)) == 1
    assert model.generation_config.eos_token_id == [tok.convert_tokens_to_ids("<|im_end|>")]
    assert tok.response_template == TINY_RESPONSE_TEMPLATE
    assert processor.chat_template == tok.chat_template == TINY_VL_CHAT_TEMPLATE


def test_the_tokenizer_is_the_tiny_one_plus_the_image_tokens(processor, tiny_tokenizer) -> None:
    vl, tiny = (json.loads(t.backend_tokenizer.to_str())["model"] for t in (processor.tokenizer, tiny_tokenizer))
    assert vl["merges"] == tiny["merges"]
    assert len(processor.tokenizer) == len(tiny_tokenizer) + len(TINY_VL_IMAGE_TOKENS)


def test_load_tokenizer_reads_the_vision_model_directory_too(vl_dir: Path) -> None:
    tok = load_tokenizer(vl_dir)
    assert tok.chat_template == TINY_VL_CHAT_TEMPLATE and tok.response_template == TINY_RESPONSE_TEMPLATE
    assert tok.pad_token == "<|endoftext|>"


def test_same_seed_same_weights_other_seed_other_weights(vl_dir: Path, tmp_path: Path) -> None:
    reference = load_file(vl_dir / "model.safetensors")
    same = load_file(init_tiny_vision_model(tmp_path / "same", seed=0) / "model.safetensors")
    other = load_file(init_tiny_vision_model(tmp_path / "other", seed=1) / "model.safetensors")
    assert reference.keys() == same.keys() == other.keys()
    assert all(torch.equal(reference[k], same[k]) for k in reference)
    assert sum(not torch.equal(reference[k], other[k]) for k in reference) > len(reference) // 2
    assert (tmp_path / "same" / "tokenizer.json").read_text() == (vl_dir / "tokenizer.json").read_text()


def test_init_refuses_to_clobber(vl_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileExistsError, match="overwrite=True"):
        init_tiny_vision_model(vl_dir, seed=0)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="config.json"):
        init_tiny_vision_model(precious, overwrite=True, seed=0)
    assert (precious / "notes.txt").read_text() == "keep me"


def test_forward_with_an_image(model, processor) -> None:
    inputs = _inputs(processor, A, model.device)
    assert inputs["pixel_values"].shape == (1, 3, 64, 64)
    logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], len(processor.tokenizer))
    assert torch.isfinite(logits).all()


def test_changing_the_image_changes_the_logits(model, processor) -> None:
    a, b = _inputs(processor, A, model.device), _inputs(processor, _image(99), model.device)
    assert torch.equal(a["input_ids"], b["input_ids"])
    with torch.no_grad():
        logits_a, logits_b = model(**a).logits[0], model(**b).logits[0]
        again = model(**a).logits[0]
    assert torch.equal(logits_a, again)
    first_image = a["input_ids"][0].tolist().index(processor.tokenizer.convert_tokens_to_ids(IMAGE))
    # Causal: the text before the image cannot see it; everything from the image on does.
    assert torch.allclose(logits_a[:first_image], logits_b[:first_image], atol=1e-6)
    after = (logits_a[first_image:] - logits_b[first_image:]).abs().amax(dim=-1)
    assert (after > 1e-4).all()


def test_generate_with_an_image(model, processor) -> None:
    inputs = _inputs(processor, A, model.device)
    out = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:]
    assert new.shape == (6,) and int(new.max()) < len(processor.tokenizer)
    again = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(out, again)


# --- the loaders on other directories ---------------------------------------------------------------------------------


def test_load_processor_of_a_text_model_is_none(tiny_model_dir: Path) -> None:
    assert load_processor(tiny_model_dir) is None
    assert type(load_model(tiny_model_dir)).__name__ == "Qwen3ForCausalLM"


def test_bad_directories_are_clear_errors(vl_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_processor(tmp_path / "no-such-model")
    (tmp_path / "file.txt").write_text("")
    with pytest.raises(NotADirectoryError, match="file.txt"):
        load_processor(tmp_path / "file.txt")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_processor(tmp_path)
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    for loader in (load_model, load_processor):
        with pytest.raises(ValueError, match="not a config transformers knows"):
            loader(unknown)
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(vl_dir / name, weights_only / name)
    assert type(load_model(weights_only)).__name__ == "Gemma3ForConditionalGeneration"
    with pytest.raises(OSError, match="holds no processor"):
        load_processor(weights_only)


def test_a_qwen3_vl_directory_loads_through_the_same_function(tmp_path: Path) -> None:
    vision_tokens = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok = build_offline_tokenizer("{{ messages }}", ["<|im_end|>", *vision_tokens], eos_token="<|im_end|>",
                                  vocab_size=300, corpus=["a tiny corpus"])
    ids = {t: tok.convert_tokens_to_ids(t) for t in vision_tokens}
    config = Qwen3VLConfig(
        text_config={"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                     "rope_parameters": {"rope_type": "default", "mrope_section": [6, 5, 5],
                                         "mrope_interleaved": True}},
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 1, "out_hidden_size": 64,
                       "num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    Qwen3VLForConditionalGeneration(config).save_pretrained(tmp_path)
    Qwen2VLImageProcessorPil().save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert type(load_model(tmp_path)).__name__ == "Qwen3VLForConditionalGeneration"
    if find_spec("torchvision") is None:  # every Qwen-VL processor holds a video processor, which needs torchvision
        with pytest.raises(ImportError, match="torchvision|Torchvision"):
            load_processor(tmp_path)
    else:
        assert type(load_processor(tmp_path)).__name__ == "Qwen3VLProcessor"


# --- the chat template -----------------------------------------------------------------------------------------------


def test_text_only_chats_render_as_the_tiny_template() -> None:
    text_only = [m for m in CONVERSATION if not isinstance(m["content"], list)]
    for k in range(1, len(text_only) + 1):
        for prompt in (False, True):
            kwargs = {"tools": TOOLS, "add_generation_prompt": prompt, "return_assistant_tokens_mask": True}
            vl = render_jinja_template([text_only[:k]], chat_template=TINY_VL_CHAT_TEMPLATE, **kwargs)
            assert vl == render_jinja_template([text_only[:k]], chat_template=TINY_CHAT_TEMPLATE, **kwargs), k


def test_template_renders_images_in_user_and_tool_messages(processor) -> None:
    text = _text(processor, CONVERSATION)
    assert f"<|im_start|>user\nWhat is on screen? {BOI}<|im_end|>\n" in text
    assert f"<|im_start|>user\n<tool_response>\n{BOI}\n</tool_response><|im_end|>\n" in text
    assert f"<tool_response>\nzoomed: {BOI}\n</tool_response>\n<tool_response>\nno image this time\n" in text
    assert f"<|im_start|>user\n{BOI} And this?<|im_end|>\n" in text
    assert text.endswith(f"<tool_response>\n{BOI}{BOI}\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\nDone.<|im_end|>\n")
    assert text.count(BOI) == len(_images(CONVERSATION)) == 6
    openai = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]}]
    assert processor.tokenizer.apply_chat_template(openai, tokenize=False) == f"<|im_start|>user\n{BOI}<|im_end|>\n"


def test_template_is_prefix_preserving_with_images_in_text_and_tokens(processor) -> None:
    for k in range(1, len(CONVERSATION)):
        shorter, longer = CONVERSATION[:k], CONVERSATION[: k + 1]
        assert _text(processor, longer).startswith(_text(processor, shorter)), k
        assert _ids(processor, longer)[: len(_ids(processor, shorter))] == _ids(processor, shorter), k
        if CONVERSATION[k]["role"] == "assistant":
            prompt = _ids(processor, shorter, add_generation_prompt=True)
            assert _ids(processor, longer)[: len(prompt)] == prompt, k


def test_trl_and_trajlab_accept_the_template(processor) -> None:
    tok = processor.tokenizer
    assert has_generation_markers(tok.chat_template)
    assert is_chat_template_prefix_preserving(tok)
    assert is_chat_template_stop_token_trained(tok)
    assert resolve_chat_template(tok) == TINY_VL_CHAT_TEMPLATE


def test_each_image_expands_to_its_own_tokens(processor) -> None:
    out = processor(text=[_text(processor, CONVERSATION)], images=[_images(CONVERSATION)], return_tensors="pt")
    assert out["pixel_values"].shape == (6, 3, 64, 64)  # every size is resized to 64x64
    decoded = processor.tokenizer.decode(out["input_ids"][0])
    block = f"\n\n{BOI}{IMAGE * TINY_VL_TOKENS_PER_IMAGE}{EOI}\n\n"
    assert decoded.count(block) == decoded.count(BOI) == decoded.count(EOI) == 6
    assert decoded.count(IMAGE) == 6 * TINY_VL_TOKENS_PER_IMAGE
    assert decoded.replace(block, BOI) == _text(processor, CONVERSATION)
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE)
    assert out["token_type_ids"][0].tolist() == [int(i == image_id) for i in out["input_ids"][0].tolist()]


def test_assistant_mask_covers_exactly_the_assistant_output(processor) -> None:
    out = processor.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    ids, mask = list(out["input_ids"][0]), list(out["assistant_masks"][0])
    masked = processor.tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    outputs = []
    for k, message in enumerate(CONVERSATION):
        if message["role"] == "assistant":
            prompt = _text(processor, CONVERSATION[:k], add_generation_prompt=True)
            outputs.append(_text(processor, CONVERSATION[: k + 1])[len(prompt):].removesuffix("\n"))
    assert masked == "".join(outputs)
    assert BOI not in masked and IMAGE not in masked


def test_parse_response_after_images(processor) -> None:
    k = 4  # content and two calls, one with string arguments, after two images
    prompt = _text(processor, CONVERSATION[:k], add_generation_prompt=True)
    generated = _text(processor, CONVERSATION[: k + 1])[len(prompt):]
    assert processor.parse_response(generated, prefix=prompt) == {
        "role": "assistant",
        "content": "Two zooms.",
        "tool_calls": [_call("zoom", {"x": 1}), _call("zoom", {"x": 2})],
    }


def test_other_part_types_are_an_error_not_dropped(processor) -> None:
    video = [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"}]}]
    with pytest.raises(TemplateError, match="text and image parts, not video"):
        processor.tokenizer.apply_chat_template(video, tokenize=False)


def test_named_tokens_must_be_special() -> None:
    with pytest.raises(ValueError, match="special_tokens"):
        build_offline_tokenizer("{{ messages }}", ["</s>"], eos_token="</s>", corpus=["a b"],
                                named_tokens={"image_token": "<img>"})
