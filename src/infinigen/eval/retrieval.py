"""Generated long-context retrieval prompts (passkey, needle in a haystack) of an exact token length.

Each case carries its answer as token ids, so whether a model would retrieve it can be checked by
teacher forcing (one pass over prompt + answer through the real decode path, see `answer_correct`)
instead of a free-running generate loop, and every cache policy is judged on the same tokens.

Prompts are assembled in token space from pieces encoded separately (add_special_tokens=False),
so lengths are exact. The pieces are cut so that every seam falls where the tokenizer itself
would split (before a space-led word, around punctuation or newlines): with byte-level BPE
tokenizers such as SmolLM2's, tokenizing the decoded prompt gives the prompt ids back, except
possibly at the single point where the filler/haystack is trimmed. The answer ids are always the
tail of the joint encoding of question + answer (checked), so prompt_ids + answer_ids is exactly
what the tokenizer produces for the joint text at the boundary that matters.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from infinigen.eval.datasets import text_ids

PASSKEY_PREAMBLE = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n"
)
PASSKEY_FILLER = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
PASSKEY_KEY = "The pass key is {key}. Remember it. {key} is the pass key."
# a newline before the question, as in the original passkey prompt (its lines are joined by "\n")
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
NEEDLE_QUESTION = "\n\nWhat is the best thing to do in San Francisco? Answer: The best thing to do in San Francisco is"
NEEDLE_ANSWER = " eat a sandwich and sit in Dolores Park on a sunny day."

MIN_FILLER_TOKENS = 16  # a prompt must hold at least this much filler/haystack
SENTENCE_END = (".", "!", "?")
SNAP_TOKENS = 50  # the needle moves at most this far to land on a sentence boundary
PARAGRAPH_SEARCH_TOKENS = 4096  # a seeded haystack start moves at most this far to a paragraph start


@dataclass
class RetrievalCase:
    task: str
    length: int  # == len(prompt_ids)
    depth: float  # requested relative position of the key/needle (0: start, 1: end)
    prompt_ids: list[int]
    answer_ids: list[int]
    answer: str
    needle_position: int  # index in prompt_ids where the key sentence / needle starts


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], clean_up_tokenization_spaces=False)


def _check_depth(depth: float) -> None:
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")


def _question_answer(tokenizer, question: str, answer: str) -> tuple[list[int], list[int]]:
    """Question ids and answer ids, the answer taken as the tail of the joint encoding, so that a
    model is scored on the tokens the tokenizer would produce for question + answer."""
    joint = _encode(tokenizer, question + answer)
    q = _encode(tokenizer, question)
    if joint[: len(q)] != q or len(joint) == len(q):
        raise ValueError(f"this tokenizer merges the question {question[-20:]!r} with the answer {answer!r}")
    return q, joint[len(q) :]


def passkey_case(tokenizer, length: int, depth: float, seed: int = 0) -> RetrievalCase:
    """The classic passkey task: a 5-digit key hidden in repeated filler sentences at `depth`."""
    _check_depth(depth)
    key = random.Random(seed).randint(10000, 99999)
    answer = f" {key}"
    pre = _encode(tokenizer, PASSKEY_PREAMBLE)
    question, answer_ids = _question_answer(tokenizer, PASSKEY_QUESTION, answer)
    key_text = PASSKEY_KEY.format(key=key)
    # every sentence but the first of the body is led by a space (as the tokenizer would split it)
    key_first, key_next = _encode(tokenizer, key_text), _encode(tokenizer, " " + key_text)
    first = [_encode(tokenizer, s) for s in PASSKEY_FILLER]
    later = [_encode(tokenizer, " " + s) for s in PASSKEY_FILLER]
    budget = length - len(pre) - len(question)  # body tokens: filler + key sentence
    filler = budget - len(key_next)
    if filler < MIN_FILLER_TOKENS:
        need = length - filler + MIN_FILLER_TOKENS
        raise ValueError(f"length {length} is too small for the passkey task: need at least {need} tokens")

    def sentence(j: int, lead: bool) -> list[int]:
        return (later if lead else first)[j % len(PASSKEY_FILLER)]

    # sentence starts in the filler alone; the key goes before the filler sentence nearest to depth
    starts = [0]
    while starts[-1] < filler:
        starts.append(starts[-1] + len(sentence(len(starts) - 1, len(starts) > 1)))
    target = depth * filler
    k = min((j for j, c in enumerate(starts) if c <= filler), key=lambda j: abs(starts[j] - target))

    body: list[int] = []
    position = -1
    j = 0
    while len(body) < budget or position < 0:
        if j == k and position < 0:
            position = len(pre) + len(body)
            body += key_next if body else key_first
        else:
            body += sentence(j, bool(body))
            j += 1
    if position - len(pre) + len(key_next) > budget:  # only if the key's two encodings differ in length
        raise ValueError(f"length {length} leaves no room for the key at depth {depth}")
    prompt = pre + body[:budget] + question
    return RetrievalCase("passkey", length, depth, prompt, answer_ids, answer, position)


def _haystack_start(tokenizer, hay: list[int], budget: int, seed: int) -> int:
    """Seed 0: the start of the essays; otherwise a seeded offset moved to the next paragraph start."""
    if seed == 0:
        return 0
    room = len(hay) - budget - 1 - PARAGRAPH_SEARCH_TOKENS
    if room <= 0:
        return 0
    start = random.Random(seed).randrange(1, room)
    for i in range(start, start + PARAGRAPH_SEARCH_TOKENS):
        prev, cur = _token_text(tokenizer, hay[i - 1]), _token_text(tokenizer, hay[i])
        if prev.isspace() and "\n\n" in prev and cur[:1] and not cur[:1].isspace():
            return i
    return start


def _followed_by(tokenizer, text: str, next_id: int) -> list[int] | None:
    """The ids of `text` as the tokenizer splits it when `next_id` follows (whitespace runs split
    differently before a word than at the end of a string); None if the two would merge."""
    joint = _encode(tokenizer, text + _token_text(tokenizer, next_id))
    return joint[:-1] if joint[-1] == next_id else None


def _needle_ids(tokenizer, window: list[int], i: int) -> list[int] | None:
    """The needle's ids if inserting before window[i] lands on a sentence boundary, else None:
    after sentence-final punctuation and a space (the needle is then led by a space), or at the
    start of a line that follows a sentence end or a blank line (the needle is then followed by a
    copy of that newline token). Copying the haystack's own whitespace keeps both seams where the
    tokenizer would split the joint text anyway."""
    cur = _token_text(tokenizer, window[i])
    if i == 0:
        return _followed_by(tokenizer, NEEDLE + ("" if cur[:1].isspace() else "\n\n"), window[0])
    prev = _token_text(tokenizer, window[i - 1])
    if prev.endswith(SENTENCE_END) and cur.startswith(" "):
        return _encode(tokenizer, " " + NEEDLE)
    if prev.endswith("\n") and prev.isspace() and cur.strip():
        before = _token_text(tokenizer, window[i - 2]) if i >= 2 else "\n"
        if before.endswith(SENTENCE_END) or "\n" in before:
            return _encode(tokenizer, NEEDLE) + [window[i - 1]]
    return None


def _place_needle(tokenizer, window: list[int], target: int, budget: int, plain: list[int]) -> tuple[int, list[int]]:
    """(position, needle ids): the sentence boundary nearest to `target` within SNAP_TOKENS (ties:
    the earlier), else `target` itself with the space-led needle."""
    last = budget - len(plain)
    best: tuple[int, list[int]] | None = None
    for i in range(max(0, target - SNAP_TOKENS), min(last, target + SNAP_TOKENS) + 1):
        ids = _needle_ids(tokenizer, window, i)
        if ids is None or i + len(ids) > budget:
            continue
        if len(ids) > len(plain) and i + len(ids) >= budget:
            continue  # a trailing newline needs haystack after it, not the question's newlines
        if best is None or abs(i - target) < abs(best[0] - target):
            best = (i, ids)
    return best if best is not None else (min(target, last), plain)


def _clean_starts(tokenizer, hay: list[int], start: int, count: int):
    """`start`, then the next `count - 1` positions where a text may begin without changing how
    its first token is split: after a whitespace token, or at a space-led token."""
    yield start
    found = 1
    for j in range(start + 1, len(hay)):
        if found >= count:
            return
        if _token_text(tokenizer, hay[j - 1]).isspace() or _token_text(tokenizer, hay[j]).startswith(" "):
            found += 1
            yield j


def needle_case(tokenizer, length: int, depth: float, seed: int = 0) -> RetrievalCase:
    """Needle in a haystack of Paul Graham essays: the San Francisco sentence at `depth`, snapped to
    the nearest sentence boundary within SNAP_TOKENS; `seed` picks the haystack's start (0: the
    start of the essays). Where the exact-length cut would leave the haystack ending in whitespace
    (which the question's leading newlines would merge with), the haystack starts a few tokens later
    instead, so that the prompt stays the tokenizer's own encoding of its text."""
    _check_depth(depth)
    question, answer_ids = _question_answer(tokenizer, NEEDLE_QUESTION, NEEDLE_ANSWER)
    plain = _encode(tokenizer, " " + NEEDLE)
    budget = length - len(question)  # haystack + needle
    hay_tokens = budget - len(plain)
    if hay_tokens < MIN_FILLER_TOKENS:
        need = length - hay_tokens + MIN_FILLER_TOKENS
        raise ValueError(f"length {length} is too small for the needle task: need at least {need} tokens")
    hay = text_ids(tokenizer, "essays")
    if budget + 1 > len(hay):
        raise ValueError(f"length {length} is too long: the essays hold {len(hay)} tokens")
    target = round(depth * hay_tokens)
    first = chosen = None
    for s in _clean_starts(tokenizer, hay, _haystack_start(tokenizer, hay, budget, seed), count=32):
        window = hay[s : s + budget + 1]  # one spare token: the one after an insertion at the end
        if len(window) < budget + 1:
            break
        position, needle = _place_needle(tokenizer, window, target, budget, plain)
        end = budget - len(needle)
        case = (window[:position] + needle + window[position:end] + question, position)
        first = first or case
        if end == position or not _token_text(tokenizer, window[end - 1]).isspace():
            chosen = case
            break
    if first is None:
        raise ValueError(f"length {length} is too long for the haystack start of seed {seed}")
    prompt, position = chosen or first  # no clean cut nearby (not seen on the essays): the first start
    return RetrievalCase("needle", length, depth, prompt, answer_ids, NEEDLE_ANSWER, position)


TASKS: dict[str, Callable[..., RetrievalCase]] = {"passkey": passkey_case, "needle": needle_case}


def retrieval_cases(
    tokenizer, task: str, lengths: Iterable[int], depths: Iterable[float] = (0.1, 0.5, 0.9), seed: int = 0
) -> list[RetrievalCase]:
    """One case per (length, depth), lengths outermost."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: choose one of {', '.join(sorted(TASKS))}")
    depths = list(depths)
    return [TASKS[task](tokenizer, n, d, seed) for n in lengths for d in depths]


def answer_correct(forced_argmax: Sequence[int], answer_ids: Sequence[int]) -> bool:
    """Teacher-forced greedy check: greedy decoding emits the answer iff, fed the answer prefix,
    the argmax at each answer position equals the next answer token. forced_argmax[j] is the
    model's argmax after the prompt and answer_ids[:j]; entries past len(answer_ids) are ignored.
    One pass over prompt + answer thus decides what a generate loop would."""
    if not answer_ids:
        raise ValueError("empty answer")
    if len(forced_argmax) < len(answer_ids):
        raise ValueError(f"{len(forced_argmax)} forced predictions for an answer of {len(answer_ids)} tokens")
    return all(int(p) == int(t) for p, t in zip(forced_argmax, answer_ids))
