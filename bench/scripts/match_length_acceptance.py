"""How often the target's greedy next token is what followed the earlier occurrence of the context's longest
repeated suffix, by the length of that match and the prompt set: the signal behind CAST's match-length bands
(castspec/policies/cast.py, AcceptanceCalibration.MATCHES; issue 37).

At every position of every reference answer, the longest suffix (2 tokens or more, up to 64) of prompt + answer so
far that occurred earlier is found, and its latest earlier occurrence's next token is compared with the answer's
next token: a lookup drafter's first guess, with the match length it would report.

Run: .venv/bin/python bench/scripts/match_length_acceptance.py REFERENCES.json OUT.md [--per-set 8] [--offset 0]
REFERENCES.json: {prompt id: greedy output ids}, e.g. bench/regret/replay-prompts-0-15-qwen1.5b-references.json."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from transformers import AutoTokenizer

from castspec.api import encode_text
from castspec.bench.prompts import load_prompt_set
from castspec.models import resolve

BINS = (2, 4, 6, 8, 12, 16, 32)


def longest_match(context: list[int], cap: int = 64) -> tuple[int, int | None]:
    """The longest k >= 1 such that context[-k:] occurred earlier (ending before the last position), and the token
    after its latest such occurrence."""
    n, best, follower = len(context), 0, None
    for end in range(n - 2, -1, -1):
        k = 0
        while k < cap and end - k >= 0 and context[end - k] == context[n - 1 - k]:
            k += 1
        if k > best:
            best, follower = k, context[end + 1]
    return best, follower


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("references")
    parser.add_argument("out")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--sets", default="mtbench,humaneval,gsm8k,repetitive")
    parser.add_argument("--per-set", type=int, default=8)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    refs = json.loads(Path(args.references).read_text())
    tokenizer = AutoTokenizer.from_pretrained(resolve(args.model))
    counts: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])  # (set, bin): [taken, seen]
    sets = [s for s in args.sets.split(",") if s]
    for name in sets:
        for prompt in load_prompt_set(name)[args.offset: args.offset + args.per_set]:
            prompt_ids = (encode_text(tokenizer, messages=prompt["messages"]) if "messages" in prompt
                          else encode_text(tokenizer, prompt=prompt["prompt"]))
            answer = refs[prompt["id"]][: args.max_new_tokens]
            for i in range(1, len(answer)):
                length, follower = longest_match(prompt_ids + answer[:i])
                if length < BINS[0]:
                    continue
                key = (name, max(b for b in BINS if b <= length))
                counts[key][0] += int(follower == answer[i])
                counts[key][1] += 1
    labels = [f"{lo}-{hi - 1}" for lo, hi in zip(BINS, BINS[1:], strict=False)] + [f"{BINS[-1]}+"]
    lines = [f"# The next token after a repeated suffix, by match length ({args.model}, greedy references)", "",
             f"`python bench/scripts/match_length_acceptance.py {args.references} {args.out} --per-set "
             f"{args.per_set} --offset {args.offset}`: per set, answers' positions whose longest repeated suffix "
             "has that length; cell: the earlier occurrence's next token was the answer's / positions.", "",
             "| set | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for name in [*sets, "all"]:
        cells = []
        for b in BINS:
            taken = sum(v[0] for (s, k), v in counts.items() if k == b and name in (s, "all"))
            seen = sum(v[1] for (s, k), v in counts.items() if k == b and name in (s, "all"))
            cells.append(f"{taken}/{seen}" + (f" ({taken / seen:.0%})" if seen else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
