"""A draft model with another tokenizer (SmolLM2 drafting for Qwen2.5, say): exact, greedy and sampled.

Two problems, two published answers:
- **Context.** The draft must read what the target wrote, in its own tokens. The target's committed
  tokens are spelled out as bytes and the draft's tokenizer re-encodes them (universal assisted
  generation: transformers' AssistedCandidateGeneratorDifferentTokenizers). Only the tail after the
  draft's last few tokens is re-encoded each step, and the draft's cache keeps the longest prefix of
  its tokens that still matches, so a step re-reads a token or two.
- **Drafts.** The draft proposes only tokens both vocabularies spell the same (token-level
  intersection, Timor et al. 2025, arXiv 2502.05202, Section 3): its distribution renormalized on
  them is a distribution over the target's ids, so the rejection sampler, which is exact for any
  draft distribution (Leviathan et al. 2023, Theorem 3.5), keeps the target's; greedy drafts are
  the argmax among them. How well the draft reads the context changes its guesses, never the output.

One request at a time (SpecEngine: generate, bench, verify, specdec.load); the draft keeps its own
positions, from 0 at the start of the window of the target's context it reads.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch

from specdec.models.runner import ModelRunner
from specdec.proposers.base import DraftProposal, ProposeContext, Proposer, committed_since
from specdec.proposers.stop_rules import ConfidenceStop, LearnedStop
from specdec.sampling.warp import sample_from_probs, warp_logits

CONTEXT_WINDOW = 256  # the target's last tokens a request's draft reads at its start
RETOKENIZED_TAIL = 4  # the draft's last tokens re-encoded with the new text (a merge may change them)
_SPECIAL = b"\x00special:"  # an added token matches only the same added token, never its text


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: each stand-in character -> its byte (printable bytes
    stand for themselves; the others, in byte order, for the characters 256, 257, ...)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    decoder, next_char = {}, 256
    for byte in range(256):
        if byte in printable:
            decoder[chr(byte)] = byte
        else:
            decoder[chr(next_char)] = byte
            next_char += 1
    return decoder


def _is_byte_level(tokenizer) -> bool:
    """Whether the tokenizer spells its tokens in GPT-2's byte-level alphabet (Qwen2, Llama 3, SmolLM)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    return '"ByteLevel"' in json.dumps(json.loads(backend.to_str()).get("decoder"))


def token_spellings(tokenizer, size: int) -> tuple[list[bytes | None], list[bytes]]:
    """(key, text) per id below size: key compares tokens across tokenizers (an added token's key is
    its content, marked, so it matches only the same added token); text is what the token writes
    (an added token: its content). None / b"" for ids the tokenizer does not define."""
    keys: list[bytes | None] = [None] * size
    texts: list[bytes] = [b""] * size
    added = set(tokenizer.get_added_vocab())
    byte_level = _is_byte_level(tokenizer)
    decoder = _byte_decoder() if byte_level else {}
    for token, index in tokenizer.get_vocab().items():
        if index >= size:
            continue
        if token in added:
            keys[index], texts[index] = _SPECIAL + token.encode(), token.encode()
            continue
        if byte_level:
            if any(char not in decoder for char in token):
                continue
            spelled = bytes(decoder[char] for char in token)
        else:  # SentencePiece: "▁" is a space, <0x41> a byte
            byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", token)
            spelled = bytes([int(byte.group(1), 16)]) if byte else token.replace("\u2581", " ").encode()
        keys[index], texts[index] = spelled, spelled
    return keys, texts


@dataclass(frozen=True)
class VocabularyBridge:
    """A draft's tokenizer beside the target's.

    draft_to_target [V_draft] int64: the target id spelled as each draft id, -1 where the target has
    no such token; target_texts / draft_texts: the bytes each id writes."""

    draft_tokenizer: object
    draft_to_target: torch.Tensor
    target_texts: list[bytes]
    draft_texts: list[bytes]

    @property
    def shared(self) -> int:
        return int((self.draft_to_target >= 0).sum())

    @classmethod
    def between(cls, draft_tokenizer, target_tokenizer, draft_vocab_size: int, target_vocab_size: int
                ) -> VocabularyBridge:
        draft_keys, draft_texts = token_spellings(draft_tokenizer, draft_vocab_size)
        target_keys, target_texts = token_spellings(target_tokenizer, target_vocab_size)
        target_of = {}
        for index, key in enumerate(target_keys):
            if key is not None:
                target_of.setdefault(key, index)
        mapping = torch.tensor([target_of.get(key, -1) if key is not None else -1 for key in draft_keys])
        if int((mapping >= 0).sum()) == 0:
            raise ValueError("the draft's and the target's tokenizers spell no token the same: nothing to draft")
        return cls(draft_tokenizer, mapping, target_texts, draft_texts)


def _complete_utf8(data: bytes) -> int:
    """Length of data's longest prefix that does not end inside a UTF-8 character."""
    end = len(data)
    for back in range(1, min(4, end) + 1):
        byte = data[end - back]
        if byte & 0xC0 != 0x80:  # a character's first byte: is the character whole?
            width = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            return end if back >= width else end - back
    return end


class CrossVocabularyDraftProposer(Proposer):
    """runner: the draft model (one row); bridge: its vocabulary beside the target's."""

    def __init__(self, runner: ModelRunner, bridge: VocabularyBridge, confidence_threshold: float | None = None,
                 context_window: int = CONTEXT_WINDOW, stop_rule: ConfidenceStop | LearnedStop | None = None) -> None:
        self.runner, self.bridge, self.context_window = runner, bridge, context_window
        # As DraftModelProposer's: the learned rule where given, else the threshold (proposers/stop_rules.py).
        self.stop_rule = stop_rule or (None if confidence_threshold is None else ConfidenceStop(confidence_threshold))
        width = runner.vocab_size
        mapping = bridge.draft_to_target[:width]
        if mapping.shape[0] < width:  # the draft's padding rows: never drafted
            mapping = torch.cat([mapping, mapping.new_full((width - mapping.shape[0],), -1)])
        self._to_target = mapping.to(runner.device)
        self._unshared = self._to_target < 0
        self.reset()

    def reset(self) -> None:
        self.runner.reset()
        self._start = 0  # where in the target's context the window the draft reads begins
        self._seen: list[int] = []  # the target's committed tokens read, from _start
        self._text = bytearray()  # what they write
        self._ids: list[int] = []  # the draft's tokens of _text (held-back partial characters aside)
        self._ends: list[int] = []  # byte offset where each of _ids ends
        self._cached: list[int] = []  # what the draft's cache holds: _ids, then the drafts it fed

    def unread_tokens(self, context_len: int) -> int:
        if not self._seen:
            return min(context_len, self.context_window)
        return max(0, context_len - self._start - len(self._seen))

    def propose(self, ctx: ProposeContext, max_k: int) -> DraftProposal:
        max_k = min(max_k, self.runner.max_context - len(self._cached) - 2)
        if max_k < 1:
            return DraftProposal.empty(1, ctx.token_ids.device)
        logits = self._read(ctx.token_ids)  # [V_draft] at the draft's last context token
        draft_ids, target_ids, probs, survival = [], [], [], 1.0
        for i in range(max_k):
            restricted = logits.float().masked_fill(self._unshared, float("-inf"))
            if ctx.params.greedy:
                token = int(restricted.argmax())
                chosen = None
            else:
                chosen = warp_logits(restricted[None], ctx.params)  # [1, V_draft], zero off the shared tokens
                token = int(sample_from_probs(chosen, ctx.generator)[0])
                on_target = torch.zeros(ctx.vocab_size, device=chosen.device)
                shared = ~self._unshared
                on_target[self._to_target[shared]] = chosen[0, shared]
                probs.append(on_target)
            draft_ids.append(token)
            target_ids.append(int(self._to_target[token]))
            stop, survival = self._stops(restricted, chosen, token, i, survival)
            if stop or i + 1 == max_k:
                break
            position = torch.tensor([[len(self._cached)]], device=self.runner.device)
            logits = self.runner.forward(torch.tensor([[token]], device=self.runner.device), position).logits[0, -1]
            self._cached.append(token)
        return DraftProposal.of_row(target_ids, None, ctx.token_ids.device,
                                    torch.stack(probs)[None] if probs else None)

    def _stops(self, restricted: torch.Tensor, chosen: torch.Tensor | None, token: int, position: int,
               survival: float) -> tuple[bool, float]:
        """As DraftModelProposer's -k auto stop, on the distribution the token was drawn from (greedy: the
        softmax over the shared tokens) -> (stop after it, the rule's running state)."""
        if self.stop_rule is None:
            return False, survival
        probs = torch.softmax(restricted, dim=-1) if chosen is None else chosen[0]
        return self.stop_rule.stops(probs, token, position, survival)

    def _read(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Bring the draft's cache up to the target's committed tokens; its logits at the last one."""
        new = committed_since(self._seen, token_ids[:, self._start:]) if self._seen else None
        if new is None:  # a new request (or the first): read the window of its last tokens
            self.reset()
            self._start = max(0, token_ids.shape[1] - self.context_window)
            new = token_ids[0, self._start:].tolist()
        self._seen += new
        for token in new:
            self._text += self.bridge.target_texts[token] if token < len(self.bridge.target_texts) else b""
        keep = max(0, len(self._ids) - RETOKENIZED_TAIL)
        while keep and self._ends[keep - 1] < len(self._text) and self._text[self._ends[keep - 1]] & 0xC0 == 0x80:
            keep -= 1  # a byte-level token may end inside a character: re-encode from the character's start
        start = self._ends[keep - 1] if keep else 0
        whole = _complete_utf8(bytes(self._text))
        tail = self.bridge.draft_tokenizer.encode(bytes(self._text[start:whole]).decode("utf-8", errors="replace"),
                                                  add_special_tokens=False)
        self._ids = self._ids[:keep] + tail
        self._ends = self._ends[:keep] + self._tail_ends(start, tail, whole)
        if not self._ids:  # nothing the draft can read yet: read a space, drafting from there
            self._ids, self._ends = self.bridge.draft_tokenizer.encode(" ", add_special_tokens=False), [0]
        same = 0
        for cached, wanted in zip(self._cached, self._ids):
            if cached != wanted:
                break
            same += 1
        same = min(same, len(self._ids) - 1)  # the last token is fed again: its logits draft
        self.runner.truncate([same])
        device = self.runner.device
        feed = torch.tensor([self._ids[same:]], device=device)
        logits = self.runner.forward(feed, torch.arange(same, len(self._ids), device=device)[None],
                                     last_n_logits=1).logits[0, -1]
        self._cached = list(self._ids)
        return logits

    def _tail_ends(self, start: int, tail: list[int], whole: int) -> list[int]:
        """Byte offsets where the re-encoded tail's tokens end (by the text each writes); where the
        tokenizer normalized the text so the lengths disagree, the tail's end for all of them, so the
        next step re-encodes from before it."""
        ends, offset, texts = [], start, self.bridge.draft_texts
        for token in tail:
            offset += len(texts[token]) if token < len(texts) else 0
            ends.append(offset)
        if offset != whole:
            return [start] * len(tail)
        return ends
