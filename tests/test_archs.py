"""`trajlab model init --arch`: real architectures at real widths with their real tokenizers, and a run on one."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from trajlab.cli import app
from trajlab.models.archs import ARCHS, arch_config, arch_names
from trajlab.models.devices import cpu_has_bfloat16_units
from trajlab.models.families import family, load_family_tokenizer
from trajlab.models.loading import load_model, load_tokenizer

TWIN_DTYPE = "bfloat16" if cpu_has_bfloat16_units() else "float32"

# Parameters of the published checkpoints, from their model cards (total, and without the embedding): the shapes
# copied into ARCHS must reproduce them at the real depth.
PUBLISHED = {
    "qwen3-0.6b": (0.6e9, 0.44e9),
    "qwen3-1.7b": (1.7e9, 1.4e9),
    "qwen2.5-0.5b": (0.49e9, 0.36e9),
    "llama-3.2-1b": (1.24e9, None),
}


def test_every_arch_names_the_published_model_it_copies():
    assert set(arch_names()) == set(PUBLISHED)
    for name, chosen in ARCHS.items():
        assert chosen.source in family(chosen.family)["models"], name


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_depth_has_the_published_parameter_count(name):
    with torch.device("meta"):  # shapes only: a 1.7B model costs no memory here
        model = AutoModelForCausalLM.from_config(arch_config(name))
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    expected_total, expected_body = PUBLISHED[name]
    assert total == pytest.approx(expected_total, rel=0.03), total
    if expected_body is not None:
        assert total - embedding == pytest.approx(expected_body, rel=0.03), total - embedding
    if name == "llama-3.2-1b":
        assert total == 1_235_814_400  # Meta's exact count


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_token_ids_match_the_real_tokenizer(name):
    chosen = ARCHS[name]
    tokenizer = load_family_tokenizer(chosen.family)
    config = arch_config(name)
    assert len(tokenizer) <= config.vocab_size
    stops = chosen.generation["eos_token_id"]
    assert tokenizer.eos_token_id in stops, "the template's end of turn stops generation"
    assert all(tokenizer.convert_ids_to_tokens(i).startswith("<|") for i in stops)
    assert tokenizer.convert_ids_to_tokens(config.bos_token_id) in ("<|begin_of_text|>", "<|endoftext|>")
    if "pad_token_id" in chosen.generation:
        assert chosen.generation["pad_token_id"] == tokenizer.pad_token_id


def test_unknown_arch_is_an_error_listing_the_known_ones(tmp_path):
    result = CliRunner().invoke(app, ["model", "init", "--arch", "qwen3-0.6", str(tmp_path / "m")])
    assert result.exit_code == 1
    assert "unknown architecture 'qwen3-0.6'" in result.stdout and "did you mean 'qwen3-0.6b'" in result.stdout
    assert all(name in result.stdout for name in arch_names())
    assert not (tmp_path / "m").exists()
    usage = CliRunner().invoke(app, ["model", "init", "--layers", "2", str(tmp_path / "m")])
    assert usage.exit_code == 2 and "give --arch too" in usage.stdout


def test_model_init_arch_writes_a_normal_hf_directory(tmp_path):
    out = tmp_path / "qwen2.5"
    result = CliRunner().invoke(app, ["model", "init", "--arch", "qwen2.5-0.5b", "--layers", "1", str(out)])
    assert result.exit_code == 0, result.stdout
    assert "qwen2.5-0.5b twin, 1 layers" in result.stdout
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "LICENSE-Apache-2.0"):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["hidden_size"] == 896 and config["dtype"] == "bfloat16"
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643]
    model, tokenizer = load_model(out, device="cpu"), load_tokenizer(out)
    params = sum(p.numel() for p in model.parameters())
    assert f"({params / 1e6:.2f}M parameters)" in result.stdout
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           return_dict=True, return_tensors="pt")
    assert model.generate(**prompt, max_new_tokens=2, do_sample=False).shape[1] == prompt["input_ids"].shape[1] + 2


@pytest.mark.slow(42)
def test_collect_sft_rl_eval_on_a_one_layer_qwen3_twin(tmp_path):
    """The quickstart's stages with the real Qwen3 tokenizer, template and widths: demonstrations collected in
    Qwen3's tokens, SFT, RL and a greedy evaluation all run. In bfloat16 where the CPU computes it (on an AVX2 host
    float32 takes 36 s, bfloat16 70 s)."""
    twin = tmp_path / "qwen3-0.6b"
    runner = CliRunner()
    built = runner.invoke(app, ["model", "init", "--arch", "qwen3-0.6b", "--layers", "1", str(twin)])
    assert built.exit_code == 0, built.stdout
    sets = {"run_dir": tmp_path / "run", "model.path": twin, "model.dtype": TWIN_DTYPE,
            "stages": "[collect,sft,rl,eval]", "collect.episodes": 2, "sft.max_steps": 1, "sft.batch_size": 1,
            "rl.steps": 1, "rl.tasks_per_step": 2, "rl.group_size": 2, "eval.num_tasks": 2,
            "rollout.max_turns": 4, "rollout.max_new_tokens": 64, "rollout.max_episode_tokens": 2048}
    args = ["run", "configs/quickstart.yaml", *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]
    result = runner.invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.stdout
    run = tmp_path / "run"
    demo = json.loads((run / "demos.jsonl").read_text().splitlines()[0])
    qwen3 = load_tokenizer(twin)
    assert qwen3.decode(demo["tokens"]["prompt_ids"]).startswith("<|im_start|>system\n")
    assert json.loads((run / "sft" / "final" / "config.json").read_text())["hidden_size"] == 1024
    assert (run / "rl" / "final" / "model.safetensors").is_file()
    assert [r["label"] for r in json.loads((run / "results.json").read_text())] == ["rl"]
