"""Rollouts made by hand for the trainer's tests: a real tokenizer's tokens, a real model's logprobs."""

import torch

from trajlab.rollout.types import TokenRecord, Trajectory


def trajectory_with_model_logprobs(model, tokenizer, loss_mask):
    prompt = tokenizer.encode("<|im_start|>user\nCompute (1 + 2) * 3.<|im_end|>\n<|im_start|>assistant\n",
                              add_special_tokens=False)
    completion = tokenizer.encode("<tool_call>\n{\"name\": \"add\"", add_special_tokens=False)[: len(loss_mask)]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, :-1]
    full = torch.log_softmax(logits, -1).gather(-1, torch.tensor(prompt + completion)[1:, None]).squeeze(-1)
    logprobs = [full[len(prompt) - 1 + i].item() if bit else None for i, bit in enumerate(loss_mask)]
    tokens = TokenRecord(prompt_ids=prompt, completion_ids=completion, loss_mask=loss_mask, logprobs=logprobs)
    return Trajectory(id="t", env="arithmetic", task={}, messages=[], tools=[], reward=1.0, status="success",
                      tokens=tokens)

def masked_logprob(model, batch):
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    lp = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    return (lp * batch["loss_mask"][:, 1:]).sum().item()

def sampled_by(sampler, trainer, tokenizer, masks):
    """Trajectories whose logprobs are ``sampler``'s, to be trained on by ``trainer``; and the trainer's logprobs."""
    sampled = [trajectory_with_model_logprobs(sampler, tokenizer, mask) for mask in masks]
    own = [trajectory_with_model_logprobs(trainer, tokenizer, mask) for mask in masks]
    return sampled, [[lp or 0.0 for lp in t.tokens.logprobs] for t in own]
