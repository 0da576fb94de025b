"""Training data in the target's own words: the first user turn of each conversation, answered by the target.

A head learns to predict the target; trained on another model's answers (ShareGPT's are ChatGPT's) it learns a
distribution the target will not produce when it drafts. Regenerating the answers (as HASS, Medusa-2 and
EAGLE-3 do) removes that mismatch at the price of one target decode per token, so it runs batched (HF
`generate`, greedy by default, left padding), writes each finished batch to a JSONL file at once and, run again
on the same file, continues after the conversations already there. The file is what `train-head --data` reads."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from castspec.api import stop_token_ids
from castspec.errors import CastspecError


def _done_ids(out: Path) -> set[int]:
    if not out.exists():
        return set()
    done = set()
    for number, line in enumerate(out.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            done.add(int(json.loads(line)["id"]))
        except (ValueError, KeyError, TypeError) as error:
            raise CastspecError(f"{out} line {number} is not a line this command wrote ({error}); "
                                "give another --out") from None
    return done


@torch.inference_mode()
def regenerate(model, tokenizer, conversations: list[list[dict]], out: Path, max_new_tokens: int = 192,
               max_prompt_tokens: int = 128, batch_size: int = 32, temperature: float = 0.0) -> dict:
    """Answer the first user turn of each conversation with the target and append {"id", "messages",
    "new_tokens", "finished"} lines to `out`. Prompts longer than `max_prompt_tokens` are skipped (their number
    is reported); the rest run shortest first so that a batch pads little."""
    prompts = []
    for number, turns in enumerate(conversations):
        ids = tokenizer.apply_chat_template(turns[:1], tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        if len(ids) <= max_prompt_tokens:
            prompts.append((number, ids))
    if not prompts:
        raise CastspecError(f"no first turn fits in --max-prompt-tokens {max_prompt_tokens}")
    done = _done_ids(out)
    todo = sorted((p for p in prompts if p[0] not in done), key=lambda p: (len(p[1]), p[0]))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = stop_token_ids(model, tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="regenerate answers", unit="conv")
    generated, start = 0, time.perf_counter()
    with out.open("a") as sink:
        for at in range(0, len(todo), batch_size):
            batch = todo[at: at + batch_size]
            width = max(len(ids) for _, ids in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            attention = torch.zeros(len(batch), width, dtype=torch.long)
            for row, (_, ids) in enumerate(batch):  # left padding: every row's next token is at the same column
                input_ids[row, width - len(ids):] = torch.tensor(ids)
                attention[row, width - len(ids):] = 1
            sampling = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0} if temperature > 0 \
                else {"do_sample": False}
            result = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                                    pad_token_id=pad, **sampling)
            for row, (number, _) in enumerate(batch):
                new = result[row, width:].tolist()
                ends = [i for i, token in enumerate(new) if token in stops]
                new = new[: ends[0]] if ends else new
                answer = tokenizer.decode(new, skip_special_tokens=True)
                user = conversations[number][0]
                sink.write(json.dumps({"id": number, "new_tokens": len(new), "finished": bool(ends),
                                       "messages": [user, {"role": "assistant", "content": answer}]}) + "\n")
                generated += len(new)
            sink.flush()  # a batch is on disk before the next starts: an interrupted run loses one batch at most
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - start):.0f}")
    bar.close()
    return {"conversations": len(prompts), "skipped_long_prompts": len(conversations) - len(prompts),
            "generated_now": len(todo), "new_tokens_now": generated,
            "seconds": round(time.perf_counter() - start, 1), "out": str(out)}
