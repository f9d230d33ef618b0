"""Peak memory of one RL update with a real vocabulary, trajlab vs TRL's GRPOTrainer loss; rollouts vs their floor.

    python benchmarks/rl_memory.py                      # updates at 512, 2048 and 8192 tokens; rollout batch
    python benchmarks/rl_memory.py --quick              # smoke check: short episodes, small rollout batch
    python benchmarks/rl_memory.py --rl-steps 4x4 16x16  # only whole `trajlab rl` steps (3. below)

Every measurement runs in its own fresh interpreter, one after the other, so peaks never mix; the peak is the child's
``ru_maxrss`` (whole process: interpreter, torch, model, optimizer, the step), and "step" is that peak minus the
resident memory just before the measured work began.

1. **Update** on a model with Qwen3's real vocabulary (151,936) and the tiny model's shape (``TINY_MODEL_CONFIG``:
   4 layers, hidden 192, tied embeddings; about 30M parameters, float32, random weights, built from the config),
   a batch of ``--batch`` episodes of L tokens each (``--prompt-tokens`` of prompt, the rest model tokens, all with
   loss), synthetic token ids. One forward + backward + AdamW step, no KL term, temperature 1:
   - ``trajlab``: ``trajlab.train.loss.policy_loss`` (GRPO, clipped ratio against the rollout's logprobs);
   - ``trl``: ``GRPOTrainer._compute_loss`` of a real TRL 1.16 trainer built on the same model (``loss_type="grpo"``,
     ``beta=0``), fed the same batch as its ``inputs`` dict (prompt/completion ids and masks, per-sequence
     advantages); TRL's trainer adds its fused, tiled LM head to the model as it always does;
   - ``naive``: main's code before this change (full float32 ``log_softmax`` over (B, L, V), entropy from it), kept
     here only to show the difference; skipped above ``--naive-max`` tokens (8192 x 151,936 x 4 bytes is 5 GB per
     sequence, several times over with autograd).
   Both then run ``backward()`` and the same ``torch.optim.AdamW`` step.
2. **Rollout batch** on the tiny model (``init_tiny_model``): ``--rollout-batch`` prompts of ``--rollout-prompt``
   random tokens, each continued by exactly ``--rollout-tokens`` tokens (the model's eos is unset for both, so no
   row stops early), sampled at temperature 1:
   - ``trajlab``: ``HFGenerator.generate`` for every prompt at once (one batch), logprobs and prefix states kept;
   - ``generate``: plain ``model.generate(..., use_cache=True)`` on the same left-padded prompts: the floor.
   Each framework runs alone in a fresh process (``--rounds`` processes each, alternating): one warm-up batch, whose
   peak is the memory reported, then ``--repeats`` timed batches; wall time is the median over all of them.
   trajlab's prefix cache is cleared between batches so each batch reads its prompts again.
3. **RL step** (``--rl-steps TASKSxGROUP ...``, instead of 1 and 2): one step of the ``trajlab rl`` command, rollouts
   and update, in its own process, on the update's model (Qwen3's vocabulary at the tiny model's depth, saved with the
   tiny tokenizer): the arithmetic env, one turn of exactly ``--rl-new-tokens`` new tokens (its random weights
   practically never sample the end of turn), ``kl_coef`` 0.01 (a reference model is kept), every other setting the
   command's default. The peak is the command's ``ru_maxrss`` as ``wait4`` reports it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

QWEN3_VOCAB = 151_936
ROLLOUTS = ("generate", "trajlab")


def rss_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


# --- update workers ---


def real_vocab_model(seed: int) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trajlab.models.tiny import TINY_MODEL_CONFIG

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=QWEN3_VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                         **TINY_MODEL_CONFIG)
    return Qwen3ForCausalLM(config).train()


def synthetic_batch(batch: int, length: int, prompt: int, seed: int, vocab: int = QWEN3_VOCAB,
                    device: str = "cpu") -> dict[str, Any]:
    """``batch`` episodes of ``length`` random token ids below ``vocab`` on ``device``, ``prompt`` of them without loss,
    in the shape :func:`trajlab.train.batches.padded_batch` gives the loss; advantages from -1 to 1 across rows."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, vocab, (batch, length), generator=generator)  # (B, T)
    completion = length - prompt
    tensors = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "loss_mask": torch.cat([torch.zeros(batch, prompt), torch.ones(batch, completion)], dim=1),
        "old_logprobs": torch.cat([torch.zeros(batch, prompt), torch.full((batch, completion), -12.0)], dim=1),
        "advantages": torch.cat([torch.zeros(batch, prompt), torch.linspace(-1, 1, batch)[:, None].expand(-1,
                                                                                             completion)], dim=1),
    }
    tensors["sequence"] = torch.arange(batch).unsqueeze(1).expand(-1, length)  # each row one rollout
    return {name: tensor.to(device) for name, tensor in tensors.items()} | {
        "completion_start": prompt, "images": [], "completions": [(row, 0) for row in range(batch)]}


def naive_batch_logprobs(model: Any, batch: dict[str, Any], temperature: float, processor: Any = None) -> Any:
    """Main's path before this change: the full float32 log-softmax (B, L, V), gathered, and the entropy from it
    (text only: ``processor`` is batch_logprobs' argument, unused here)."""
    import torch

    input_ids, attention, start = batch["input_ids"], batch["attention_mask"], batch["completion_start"]
    logits = model(input_ids=input_ids, attention_mask=attention, logits_to_keep=input_ids.shape[1] - start + 1).logits
    log_probs = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)  # (B, L, V)
    logprobs = log_probs.gather(-1, input_ids[:, start:].unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logprobs, entropy


def update_loss(framework: str, model: Any, tokenizer_dir: Path, rows: int,
                device: str = "cpu") -> tuple[Any, Callable[[dict[str, Any]], Any]]:
    """The model a step trains (TRL's trainer patches its own LM head in) and a function computing one step's loss
    tensor on a batch of ``rows`` episodes (:func:`synthetic_batch`) the way ``framework`` (trajlab, trl, naive)
    does; no KL term, temperature 1. ``tokenizer_dir``: a tokenizer for TRL's trainer (the ids are synthetic)."""
    from trajlab.config import RLSettings
    from trajlab.train import loss

    if framework == "trl":
        trainer = trl_trainer(model, tokenizer_dir, rows, device)

        def trl_loss(batch: dict[str, Any]) -> Any:
            prompt = batch["completion_start"]
            return trainer._compute_loss(trainer.model, {
                "prompt_ids": batch["input_ids"][:, :prompt],
                "prompt_mask": batch["attention_mask"][:, :prompt],
                "completion_ids": batch["input_ids"][:, prompt:],
                "completion_mask": batch["attention_mask"][:, prompt:],
                "advantages": batch["advantages"][:, prompt],  # (B,): one advantage per sequence
                "old_per_token_logps": batch["old_logprobs"][:, prompt:],
            })

        return trainer.model, trl_loss
    if framework == "naive":
        loss.batch_logprobs = naive_batch_logprobs
    settings = RLSettings(kl_coef=0.0, temperature=1.0, estimator="grpo")
    return model, lambda batch: loss.policy_loss(model, None, batch, settings, normaliser=float(rows))["loss_tensor"]


def update_worker(framework: str, args: argparse.Namespace, length: int) -> dict[str, Any]:
    import torch

    from trajlab.train import logprobs

    if args.chunk_tokens:
        logprobs.CHUNK_TOKENS = args.chunk_tokens

    model = real_vocab_model(args.seed)
    batch = synthetic_batch(args.batch, length, args.prompt_tokens, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, step_loss = update_loss(framework, model, args.tiny_model, args.batch)

    before = rss_bytes()
    began = time.perf_counter()
    step_loss(batch).backward()
    optimizer.step()
    optimizer.zero_grad()
    seconds = time.perf_counter() - began
    return {"peak": peak_bytes(), "before": before, "seconds": seconds}


def trl_trainer(model: Any, tokenizer_dir: Path, batch: int, device: str = "cpu") -> Any:
    """A real GRPOTrainer around ``model`` on ``device`` (its constructor patches in TRL's fused LM head); no
    training loop runs."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    from trajlab.models.loading import load_tokenizer

    tokenizer: PreTrainedTokenizerFast = load_tokenizer(tokenizer_dir)  # a processing class; ids are synthetic
    on_cpu = device == "cpu"
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="rl-memory-trl-"), use_cpu=on_cpu, bf16=not on_cpu, report_to="none",
        # GRPO's config checks need a group of 2 or more; the loss below runs on the given batch, whatever its size.
        save_strategy="no", per_device_train_batch_size=max(2, batch), num_generations=max(2, batch),
        gradient_accumulation_steps=1, beta=0.0, loss_type="grpo", temperature=1.0, disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                          args=config, train_dataset=Dataset.from_list([{"prompt": "x"}] * max(2, batch)),
                          processing_class=tokenizer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which does not run here
    return trainer


# --- rollout workers ---


def rollout_runner(framework: str, args: argparse.Namespace) -> Any:
    """A function that generates the benchmark's rollout batch once and returns each row's new-token count."""
    import asyncio

    import torch

    from trajlab.inference.base import GenerationRequest, SamplingParams
    from trajlab.inference.hf import HFGenerator
    from trajlab.models.loading import load_model, load_tokenizer

    model = load_model(args.tiny_model).eval()
    tokenizer = load_tokenizer(args.tiny_model)
    model.generation_config.eos_token_id = None  # every row generates exactly --rollout-tokens tokens
    generator = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, len(tokenizer), (args.rollout_prompt,), generator=generator).tolist()
               for _ in range(args.rollout_batch)]
    n = args.rollout_tokens
    if framework == "trajlab":
        hf = HFGenerator(model, tokenizer, max_batch_size=len(prompts))
        params = SamplingParams(max_new_tokens=n, temperature=1.0)

        async def batch() -> list[Any]:
            return await asyncio.gather(*(hf.generate(GenerationRequest(p, params)) for p in prompts))

        def run() -> list[int]:
            hf.prefix_cache.clear()  # each repeat reads its prompts again, as a first turn does
            return [len(r.token_ids) for r in asyncio.run(batch())]

        return run
    pad = tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    @torch.inference_mode()
    def run() -> list[int]:
        out = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=n, do_sample=True,
                             temperature=1.0, top_p=None, top_k=None, pad_token_id=pad, use_cache=True)
        return [out.shape[1] - width] * len(prompts)

    return run


def rollout_worker(framework: str, args: argparse.Namespace) -> dict[str, Any]:
    """One framework's rollout batches in this fresh process: peak memory of the first, wall times of the rest.

    Each framework runs alone in its process: torch from two threads of one process (trajlab generates on its own
    thread, plain ``generate`` on the main one) gives each thread an OpenMP team, and on a machine with as many cores
    as one team has threads libgomp then stops spin-waiting, which slows the tiny model's small ops on both sides.
    """
    import torch

    torch.manual_seed(args.seed)
    before = rss_bytes()
    run = rollout_runner(framework, args)
    tokens = sum(run())  # warm-up; its peak is the batch's memory
    peak = peak_bytes()
    times = []
    for _ in range(args.repeats):
        began = time.perf_counter()
        tokens = sum(run())
        times.append(time.perf_counter() - began)
    return {"peak": peak, "before": before, "tokens": tokens, "times": times}


# --- whole RL steps ---


def rl_step(args: argparse.Namespace, tasks: int, group: int) -> dict[str, Any]:
    """One ``trajlab rl`` step in a fresh process: its peak RSS and the step's own timings."""
    model = args.work_dir / "qwen3-vocab-tiny-depth"
    if not (model / "config.json").exists():
        from trajlab.models.loading import load_tokenizer
        from trajlab.models.tiny import save_tiny_model

        tokenizer = load_tokenizer(args.tiny_model)
        save_tiny_model(real_vocab_model(args.seed), tokenizer, tokenizer, model)
    out = Path(tempfile.mkdtemp(prefix="rl-memory-step-", dir=args.work_dir))
    command = [sys.executable, "-m", "trajlab.cli", "--quiet", "rl", "--out", str(out), "--model", str(model), "--env",
               "arithmetic", "--steps", "1", "--tasks-per-step", str(tasks), "--group-size", str(group),
               "--kl-coef", "0.01", "--seed", str(args.seed), "--set", "rollout.max_turns=1",
               "--set", f"rollout.max_new_tokens={args.rl_new_tokens}"]
    began = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - began
    if status != 0:
        return {"error": f"exit {status}: {stderr.strip().splitlines()[-1:]}"}
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    return {"peak": usage.ru_maxrss * 1024, "seconds": seconds, "rollout_s": metrics["perf/rollout_s"],
            "update_s": metrics["perf/update_s"], "episodes": metrics["rollout/episodes"]}


def rl_steps(args: argparse.Namespace) -> None:
    print(f"RL step: vocab {QWEN3_VOCAB}, tiny depth, one turn of {args.rl_new_tokens} new tokens, kl_coef 0.01")
    print("| tasks x rollouts | peak RSS GB | rollouts s | update s | command s |")
    print("|---|---|---|---|---|")
    for spec in args.rl_steps:
        tasks, group = (int(part) for part in spec.split("x"))
        r = rl_step(args, tasks, group)
        if "error" in r:
            print(f"| {spec} | {r['error']} | | | |", flush=True)
            continue
        print(f"| {spec} ({r['episodes']:.0f} episodes) | {gb(r['peak'])} | {r['rollout_s']:.1f} | "
              f"{r['update_s']:.1f} | {r['seconds']:.1f} |", flush=True)


# --- the driver ---


def run_child(args: argparse.Namespace, kind: str, framework: str, length: int = 0) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("r", suffix=".json") as result:
        command = [sys.executable, __file__, "--worker", kind, framework, str(length), result.name,
                   *sys.argv[1:]]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
            return {"error": f"exit {done.returncode}: {tail[0][:200]}"}
        return json.loads(Path(result.name).read_text())


def gb(value: float) -> str:
    return f"{value / 2**30:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[512, 2048, 8192],
                        help="tokens per episode (none: only the rollout comparison)")
    parser.add_argument("--batch", type=int, default=2, help="episodes per update")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--chunk-tokens", type=int, help="trajlab's logprobs.CHUNK_TOKENS (default: its own)")
    parser.add_argument("--naive-max", type=int, default=2048, help="longest episode the naive path runs at")
    parser.add_argument("--rollout-batch", type=int, default=32)
    parser.add_argument("--rollout-prompt", type=int, default=256)
    parser.add_argument("--rollout-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="fresh processes per rollout framework, alternating")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "trajlab-rl-memory")
    parser.add_argument("--rl-steps", nargs="*", default=[], metavar="TASKSxGROUP",
                        help="only whole `trajlab rl` steps of these sizes, e.g. 4x4 16x16")
    parser.add_argument("--rl-new-tokens", type=int, default=256, help="new tokens of an RL step's one turn")
    parser.add_argument("--quick", action="store_true", help="lengths 256 512, rollouts 8 x 32 tokens")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.rollout_batch, args.rollout_tokens, args.repeats = [256, 512], 8, 32, 1
    args.tiny_model = args.work_dir / f"tiny-seed{args.seed}"

    if args.worker:
        kind, framework, length, out = args.worker

        result = (update_worker(framework, args, int(length)) if kind == "update" else rollout_worker(framework, args))
        Path(out).write_text(json.dumps(result))
        return

    from trajlab.models.tiny import init_tiny_model

    if not (args.tiny_model / "config.json").exists():
        init_tiny_model(args.tiny_model, seed=args.seed, overwrite=True)
    if args.rl_steps:
        rl_steps(args)
        return
    print(f"update: vocab {QWEN3_VOCAB}, batch {args.batch}, prompt {args.prompt_tokens} tokens, no KL, AdamW")
    print("| tokens/episode | framework | peak RSS GB | step's own GB | update s |")
    print("|---|---|---|---|---|")
    for length in args.lengths:
        for framework in ("trajlab", "trl", "naive"):
            if framework == "naive" and length > args.naive_max:
                print(f"| {length} | naive (main before) | skipped (> --naive-max {args.naive_max}) | | |")
                continue
            r = run_child(args, "update", framework, length)
            label = {"naive": "naive (main before)"}.get(framework, framework)
            if "error" in r:
                print(f"| {length} | {label} | {r['error']} | | |", flush=True)
            else:
                print(f"| {length} | {label} | {gb(r['peak'])} | {gb(r['peak'] - r['before'])} | "
                      f"{r['seconds']:.2f} |", flush=True)

    print(f"\nrollout batch: tiny model, {args.rollout_batch} prompts x {args.rollout_prompt} tokens, "
          f"{args.rollout_tokens} new tokens each, temperature 1; wall time: median of {args.rounds} processes x "
          f"{args.repeats} batches, alternating")
    print("| framework | s/batch | all runs s | generated tokens | tokens/s | peak RSS GB | time vs generate |")
    print("|---|---|---|---|---|---|---|")
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in ROLLOUTS}
    for _ in range(args.rounds):  # alternating processes: a burst of other work does not land on one side only
        for framework in ROLLOUTS:
            results[framework].append(run_child(args, "rollout", framework))
    failed = next((r["error"] for runs in results.values() for r in runs if "error" in r), None)
    if failed:
        print(f"| rollout | {failed} | | | | | |")
        return
    seconds = {name: statistics.median(t for r in runs for t in r["times"]) for name, runs in results.items()}
    for framework, runs in results.items():
        times = " ".join(f"{t:.2f}" for r in runs for t in r["times"])
        tokens, peak = runs[0]["tokens"], max(r["peak"] for r in runs)
        print(f"| {framework} | {seconds[framework]:.3f} | {times} | {tokens} | {tokens / seconds[framework]:.0f} | "
              f"{gb(peak)} | {seconds[framework] / seconds['generate']:.2f}x |")

if __name__ == "__main__":
    main()
