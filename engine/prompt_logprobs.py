"""Prompt logprobs (SamplingParams.prompt_logprobs): the logprob of every prompt token after
the first, given the tokens before it, and the top-N at its position.

A step's logits come back in `model_runner.logit_rows` order: for each scheduled request,
its prompt-logprob positions, then its sampling row. `take_prompt_logprobs` records the
first kind on their requests and returns the sampling rows alone, so the sampler sees what
it always sees. Positions are recorded in prompt order and at most once: a prompt computed
chunk by chunk appends chunk by chunk, and one recomputed after preemption adds nothing twice.
"""

from __future__ import annotations

import torch

from vllm_cluster.engine.request import Request, RequestId, TokenLogprobs
from vllm_cluster.engine.scheduler_output import SchedulerOutput


def take_prompt_logprobs(
    output: SchedulerOutput, logits: torch.Tensor, requests: dict[RequestId, Request]
) -> torch.Tensor:
    """The sampling rows of `logits` [R, V] -> [N, V]; the prompt rows go onto their requests."""
    if not any(item.num_prompt_logits for item in output.scheduled):
        return logits
    sample_rows: list[int] = []
    row = 0
    for item in output.scheduled:
        if item.num_prompt_logits:
            request = requests.get(item.request_id)
            if request is not None:  # not finished (aborted) meanwhile
                record(request, item.num_computed_tokens, logits[row : row + item.num_prompt_logits])
            row += item.num_prompt_logits
        if item.samples:
            sample_rows.append(row)
            row += 1
    assert row == logits.shape[0], f"{logits.shape[0]} logit rows for {row} expected"
    return logits[torch.tensor(sample_rows, dtype=torch.long, device=logits.device)]


def record(request: Request, start: int, logits: torch.Tensor) -> None:
    """Append the logprobs of prompt tokens start + 1, ... from the logits [P, V] of
    positions start, ... (those already recorded are skipped)."""
    num_top = request.sampling_params.prompt_logprobs
    assert num_top is not None
    skip = len(request.prompt_logprobs) - start
    assert skip >= 0, f"prompt logprobs of {request.request_id} would leave a gap at position {start}"
    if skip >= logits.shape[0]:
        return
    logprobs = torch.log_softmax(logits[skip:].float(), dim=-1)  # [P', V]
    begin = start + skip + 1
    targets = request.prompt_token_ids[begin : begin + logprobs.shape[0]]
    target_ids = torch.tensor(targets, dtype=torch.long, device=logprobs.device).unsqueeze(1)
    values = logprobs.gather(1, target_ids)  # [P', 1]
    ranks = (logprobs > values).sum(dim=1) + 1  # [P']
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (values[:, :0], target_ids[:, :0])
    # One device-to-host copy of each, then plain Python.
    rows = zip(targets, values.squeeze(1).tolist(), ranks.tolist(), top_ids.tolist(), top_values.tolist(), strict=True)
    for token_id, value, rank, ids, tops in rows:
        top = dict(zip(ids, tops, strict=True))
        request.prompt_logprobs.append(TokenLogprobs(token_id=token_id, logprob=value, rank=rank, top=top))
