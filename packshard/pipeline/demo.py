"""The built-in demo: a generated SFT mix and a built-in tokenizer, no files and no network.

`demo_records(seed)` yields chat samples shaped like real post-training work: many short
math word problems solved step by step (a few hundred tokens each, like GSM8K) and a few long
agentic coding trajectories (8K-29K tokens: a task, then many assistant tool calls with tool
outputs such as file listings, code and test logs). Everything comes from a seeded numpy
generator, so the same seed gives the same records on every machine.

`demo_tokenizer()` is a real Hugging Face fast tokenizer built in code: byte-level (one token
per UTF-8 byte, 256 ids) plus ChatML special tokens and a ChatML chat template, so it goes
through exactly the same tokenization path as Qwen's tokenizers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np

DEMO_NUM_MATH = 3000
DEMO_NUM_TRAJECTORIES = 40
DEMO_SEQ_LEN = 32768
DEMO_CP = 8

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_NAMES = [
    "Natalia",
    "Weng",
    "Betty",
    "Julie",
    "James",
    "Albert",
    "Ken",
    "Alexis",
    "Tina",
    "Randy",
    "Mark",
    "Jasmine",
]
_ITEMS = [
    "clips",
    "apples",
    "stickers",
    "pages",
    "marbles",
    "cookies",
    "tickets",
    "books",
    "shells",
    "coins",
]
_FILES = [
    "src/core.py",
    "src/utils.py",
    "src/schema.py",
    "tests/test_core.py",
    "tests/test_schema.py",
    "setup.cfg",
    "README.md",
]
_WORDS = [
    "the",
    "value",
    "field",
    "schema",
    "load",
    "dump",
    "serialize",
    "error",
    "when",
    "returns",
    "none",
    "list",
    "dict",
    "raise",
    "expected",
    "got",
    "default",
    "missing",
    "attribute",
    "nested",
    "data",
    "type",
    "check",
    "test",
    "case",
    "input",
    "output",
]


def _math_record(rng: np.random.Generator, i: int) -> dict[str, Any]:
    name, item = _NAMES[rng.integers(len(_NAMES))], _ITEMS[rng.integers(len(_ITEMS))]
    a, b, c = (int(x) for x in rng.integers(2, 90, 3))
    k = int(rng.integers(2, 6))
    steps = [
        f"{name} starts with {a} {item}.",
        f"{name} buys {b} more, so {name} has {a} + {b} = {a + b} {item}.",
        f"{name} gives away {c}, leaving {a + b} - {c} = {a + b - c} {item}.",
        f"Then the amount is multiplied by {k}: {a + b - c} * {k} = {(a + b - c) * k}.",
    ]
    extra = int(rng.integers(0, 4))
    for j in range(extra):
        d = int(rng.integers(2, 30))
        steps.append(
            f"Check {j + 1}: adding {d} and taking it away again leaves {(a + b - c) * k} {item}."
        )
    question = (
        f"{name} has {a} {item}. {name} buys {b} more {item} and then gives {c} of them to a friend. "
        f"At the end of the week the number of {item} is multiplied by {k}. How many {item} does {name} have?"
    )
    answer = "\n".join(steps) + f"\n#### {(a + b - c) * k}"
    return {
        "id": f"math-{i}",
        "messages": [
            {"role": "system", "content": "You are a careful math tutor. Show your steps."},
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ],
    }


def _tool_output(rng: np.random.Generator) -> str:
    kind = int(rng.integers(3))
    if kind == 0:
        return "\n".join(f"{f}  {int(rng.integers(200, 9000))} bytes" for f in _FILES)
    if kind == 1:
        n = int(rng.integers(20, 60))
        lines = [
            f"{j + 1:4d}    {' '.join(rng.choice(_WORDS, int(rng.integers(3, 10))))}"
            for j in range(n)
        ]
        return "\n".join(lines)
    n = int(rng.integers(5, 25))
    lines = [
        f"tests/test_core.py::test_{'_'.join(rng.choice(_WORDS, 2))} {'PASSED' if rng.random() < 0.8 else 'FAILED'}"
        for _ in range(n)
    ]
    return "============ test session starts ============\n" + "\n".join(lines) + f"\n{n} tests ran"


def _trajectory_record(rng: np.random.Generator, i: int) -> dict[str, Any]:
    target = int(rng.integers(8_000, 28_000))  # bytes = tokens for the demo tokenizer
    messages = [
        {
            "role": "system",
            "content": "You are a software agent. Use the tools to fix the issue, then submit.",
        },
        {
            "role": "user",
            "content": f"Issue #{1000 + i}: {' '.join(rng.choice(_WORDS, 40))}. Please fix it.",
        },
    ]
    size = sum(len(m["content"]) for m in messages)
    step = 0
    while size < target:
        step += 1
        tool = ["ls", "open", "pytest"][int(rng.integers(3))]
        arg = _FILES[int(rng.integers(len(_FILES)))]
        thought = f"Step {step}: {' '.join(rng.choice(_WORDS, int(rng.integers(8, 30))))}."
        call = json.dumps({"name": tool, "arguments": {"path": arg}})
        messages.append(
            {"role": "assistant", "content": f"{thought}\n<tool_call>{call}</tool_call>"}
        )
        messages.append({"role": "tool", "content": _tool_output(rng)})
        size += len(messages[-1]["content"]) + len(messages[-2]["content"])
    messages.append({"role": "assistant", "content": "The tests pass now. Submitting the fix."})
    return {"id": f"traj-{i}", "messages": messages}


def demo_records(
    seed: int = 0, num_math: int = DEMO_NUM_MATH, num_trajectories: int = DEMO_NUM_TRAJECTORIES
) -> Iterator[dict[str, Any]]:
    """The demo samples, in a fixed interleaved order (a trajectory every ~75 math chats)."""
    rng = np.random.default_rng(seed)
    total = num_math + num_trajectories
    is_traj = np.zeros(total, dtype=bool)
    is_traj[rng.choice(total, num_trajectories, replace=False)] = True
    m = t = 0
    for flag in is_traj:
        if flag:
            yield _trajectory_record(rng, t)
            t += 1
        else:
            yield _math_record(rng, m)
            m += 1


def demo_tokenizer() -> Any:
    """A byte-level Hugging Face fast tokenizer with ChatML specials and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=1 << 20,
    )
    tok.chat_template = CHATML_TEMPLATE
    tok.name_or_path = "packshard-demo-bytelevel"
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel uses)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=False)}
