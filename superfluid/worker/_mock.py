"""The mock runtime: a deterministic primitive engine that needs no model file.

The next token is a pure function of the sequence's recent context (and, when
sampling, of ``counter_seed(seed, k)``), so greedy output is identical across
restarts, batch shapes and resumes. KV is simulated per sequence and every
decode is checked to continue its sequence exactly, so executor bugs surface
as errors. Costs are real sleeps per prefill token and per decode step; an
abortable pass (``decode(rows, abort)``) polls ``abort`` every 2 ms of its
sleep and, once it is True, drops what the pass wrote and raises StepAborted.

Model spec: ``mock`` or ``mock?key=value&...`` with keys ``n_ctx`` (per-lane
window, default 4096), ``step_ms`` (per decode step, default 2), ``prefill_us``
(per prompt token, default 20), ``eos_every`` (mean reply length, default 48),
``refuse_load`` (fail to load), ``name`` (the model's name in the daemon),
``copy`` (the share of choices whose first candidate repeats what followed the
last earlier occurrence of the context's last three tokens, else two, else one,
as a model copying its prompt does: 0 by default), ``draft_us`` (the cost of each extra token of a
speculative decode row, default 0), ``drafts=0`` (refuse speculation, as a
runtime that cannot verify drafts does) and ``fim=0`` (declare no fill-in-the-middle
markers, as a model without them; the ids stay in the vocabulary).

Faults, asked for inside a prompt: ``[[mock:crash_after=N]]`` SIGKILLs the
worker when the lane would draw generated token N; ``[[mock:hang_after=N]]``
blocks the engine thread; ``[[mock:fault_after=N]]`` fails just that lane;
``[[mock:garbage_after=N]]`` writes an oversized frame header onto the link
(a malformed frame, which the daemon must answer by restarting the worker);
``[[mock:bug_after=N]]`` reports the injected fault (``Fault`` kind ``bug``),
which the daemon's loop raises on as on a bug of its own: the model's actor
fails and restarts, the other models never notice.
"""

from __future__ import annotations

import array
import hashlib
import math
import os
import re
import signal
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl

from ..proto import Sampling
from ._engine import BatchRow, ModelInfo, StepAborted
from ._executor import counter_seed

__all__ = ["InjectedBug", "LaneError", "MockEngine", "parse_mock_spec"]

ABORT_POLL_S = 0.002   # an abortable pass checks its abort callable this often
SPECIALS = {"<pad>": 0, "<s>": 1, "</s>": 2, "<|im_start|>": 3, "<|im_end|>": 4}
BYTE0 = 5
WORDS = (
    " the", " a", " model", " token", " lane", " stream", " worker", " daemon", " cache", " prefix",
    " batch", " tick", " queue", " agent", " chat", " answer", " quickly", " slowly", " and", " or",
    " with", " without", " before", " after", " every", " some", " one", " two", " three", " seven",
    " river", " mountain", " cloud", " signal", " kernel", " thread", " process", " memory", " budget",
    " is", " was", " runs", " waits", " writes", " reads", " sees", " keeps", " drops", " resumes",
    ".", ",", "\n",
)
WORD0 = BYTE0 + 256
# fill-in-the-middle markers after the words (ids below them keep their meaning), StarCoder's spelling
FIM0 = WORD0 + len(WORDS)
FIM_MARKERS = {"<fim_prefix>": FIM0, "<fim_suffix>": FIM0 + 1, "<fim_middle>": FIM0 + 2, "<repo_name>": FIM0 + 3,
               "<file_sep>": FIM0 + 4}
FIM_IDS = {"pre": FIM0, "suf": FIM0 + 1, "mid": FIM0 + 2, "rep": FIM0 + 3, "sep": FIM0 + 4}
N_VOCAB = FIM0 + len(FIM_MARKERS)
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_MARKERS = {**SPECIALS, **FIM_MARKERS}
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in _MARKERS) + ")")
_WORD_RE = re.compile(b"|".join(re.escape(w.encode()) for w in sorted(WORDS, key=len, reverse=True)))
_FAULT_RE = re.compile(r"\[\[mock:(crash_after|hang_after|fault_after|garbage_after|bug_after)=(\d+)\]\]")


class LaneError(Exception):
    """One lane failed; the others go on."""


class InjectedBug(LaneError):
    """``[[mock:bug_after=N]]``: the worker reports it as a ``Fault`` of kind ``bug``."""


MOCK_EMBED_DIM = 64


def parse_mock_spec(spec: str) -> dict[str, float]:
    opts = {"n_ctx": 4096.0, "step_ms": 2.0, "prefill_us": 20.0, "eos_every": 48.0, "refuse_load": 0.0, "n_seq": 0.0,
            "copy": 0.0, "draft_us": 0.0, "drafts": 1.0, "fim": 1.0}
    _, _, query = spec.partition("?")
    for key, value in parse_qsl(query):
        if key == "name":
            continue  # the daemon's name for this mock model
        if key not in opts:
            raise ValueError(f"unknown mock option {key!r}")
        opts[key] = float(value)
    return opts


def _h(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


class _MockSampler:
    def __init__(self, engine: MockEngine, sampling: Sampling) -> None:
        self.engine = engine
        self.sampling = sampling
        self.fault: tuple[str, int] | None = None
        self._scanned = False
        self._eos_banned = any(tok == SPECIALS["</s>"] and bias == -math.inf for tok, bias in sampling.logit_bias)

    def _scan(self, ctx: tuple[int, ...]) -> None:
        if not self._scanned:
            self._scanned = True
            m = _FAULT_RE.search(self.engine.detok(ctx).decode("utf-8", "replace"))
            if m:
                self.fault = (m.group(1), int(m.group(2)))

    def _candidates(self, ctx: tuple[int, ...], k: int) -> list[int]:
        base = _h(ctx[-6:], len(ctx))
        cands = [WORD0 + (base >> (6 * i)) % len(WORDS) for i in range(4)]
        copy = self.engine.opts["copy"]
        if copy and (base >> 40) % 1000 < copy * 1000:
            for n in (3, 2, 1):
                tail = ctx[-n:]
                at = next((end for end in range(len(ctx) - 1, n - 1, -1) if ctx[end - n:end] == tail), None)
                if at is not None and WORD0 <= ctx[at] < FIM0:
                    cands[0] = ctx[at]
                    break
        return cands

    def sample(self, out: Any, k: int) -> int:
        ctx: tuple[int, ...] = out
        self._scan(ctx)
        if self.fault is not None and k >= self.fault[1]:
            kind = self.fault[0]
            if kind == "crash_after":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "hang_after":
                time.sleep(3600)
            elif kind == "garbage_after":
                os.write(int(os.environ["SUPERFLUID_LINK_FD"]), b"\xff\xff\xff\xff garbage")
                time.sleep(3600)
            elif kind == "bug_after":
                raise InjectedBug(f"mock bug injected at token {k}")
            raise LaneError(f"mock fault injected at token {k}")
        every = max(2, int(self.engine.opts["eos_every"]))
        # a banned end (ignore_eos) first: the hash is most of the mock's cost per token
        if k >= 4 and not self._eos_banned and _h("eos", ctx[-4:], len(ctx)) % every == 0:
            return SPECIALS["</s>"]
        cands = self._candidates(ctx, k)
        for tok, bias in self.sampling.logit_bias:
            if bias > 50 and 0 <= tok < N_VOCAB:
                return tok
        if self.sampling.greedy:
            return cands[0]
        return cands[counter_seed(self.sampling.seed, k) % len(cands)]

    def logprobs(self, out: Any, token: int, n: int) -> list[Any]:
        cands = self._candidates(out, 0)
        top = [[t, self.engine.piece(t), -0.1 * (i + 1)] for i, t in enumerate(cands[:n])]
        return [-0.1 if token == cands[0] else -2.0, top]

    def accept(self, token: int) -> None:
        pass

    def close(self) -> None:
        pass


class MockEngine:
    def __init__(self, spec: str, *, n_seq: int) -> None:
        self.opts = parse_mock_spec(spec)
        if self.opts["refuse_load"]:
            raise RuntimeError("mock: refused to load (refuse_load=1)")
        n_seq = int(self.opts["n_seq"]) or n_seq
        self.info = ModelInfo(
            name="mock", architecture="mock", n_vocab=N_VOCAB, n_ctx_train=int(self.opts["n_ctx"]),
            n_seq=n_seq, n_ctx_seq=int(self.opts["n_ctx"]), kv_layout="per_seq",
            bos=SPECIALS["<s>"], eog=(SPECIALS["</s>"], SPECIALS["<|im_end|>"]),
            chat_template=CHATML, special_tokens=dict(SPECIALS), add_bos=False,
            extra={"fim": dict(FIM_IDS) if self.opts["fim"] else {}},
        )
        self.kv: list[list[int]] = [[] for _ in range(n_seq)]
        self.drafts: bool | str = True if self.opts["drafts"] else "the mock runtime was started with drafts=0"

    def capabilities(self) -> dict[str, Any]:
        return {
            "sampling": {"greedy": True, "temperature": True, "seed": True, "top_p": "the mock ignores top_p",
                         "logit_bias": True},
            "logprobs": True,
            "grammar": "the mock runtime does not constrain output",
            "prefix_cache": True,
            "embeddings": True,
            "input": {"text": True, "image": "text-only runtime", "audio": "text-only runtime"},
            "fim": True if self.opts["fim"] else "the mock was started with fim=0",
        }

    def embed(self, inputs: list[list[int]], *, normalize: bool) -> tuple[int, list[bytes]]:
        """Deterministic: the mean of a fixed pseudo-random vector per token id, so texts
        sharing words point alike. Inputs longer than the window are refused, as llama.cpp's."""
        out = []
        for i, tokens in enumerate(inputs):
            if len(tokens) > self.info.n_ctx_seq:
                raise ValueError(f"input {i} has {len(tokens)} tokens; the model's window is {self.info.n_ctx_seq}")
            acc = [0.0] * MOCK_EMBED_DIM
            for tok in tokens:
                seed = _h("embed", tok)
                for d in range(MOCK_EMBED_DIM):
                    acc[d] += ((seed >> (d % 56)) & 0xFF) / 127.5 - 1.0 + 0.01 * ((tok * (d + 1)) % 7)
            vec = [v / len(tokens) for v in acc]
            if normalize:
                norm = math.sqrt(sum(v * v for v in vec)) or 1.0
                vec = [v / norm for v in vec]
            out.append(array.array("f", vec).tobytes())
        return MOCK_EMBED_DIM, out

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        out = [SPECIALS["<s>"]] if add_special else []
        parts = _SPECIAL_RE.split(text) if parse_special else [text]
        for part in parts:
            if parse_special and part in _MARKERS:
                out.append(_MARKERS[part])
                continue
            data = part.encode()
            pos = 0
            while pos < len(data):
                m = _WORD_RE.match(data, pos)
                if m:
                    out.append(WORD0 + WORDS.index(m.group().decode()))
                    pos = m.end()
                else:
                    out.append(BYTE0 + data[pos])
                    pos += 1
        return out

    def piece(self, token: int) -> bytes:
        if FIM0 <= token < N_VOCAB:
            return next(name for name, tid in FIM_MARKERS.items() if tid == token).encode()
        if token >= WORD0:
            return WORDS[token - WORD0].encode()
        if token >= BYTE0:
            return bytes([token - BYTE0])
        for name, tid in SPECIALS.items():
            if tid == token:
                return name.encode()
        raise ValueError(f"token {token} is not in the mock vocabulary")

    def detok(self, tokens: tuple[int, ...] | list[int]) -> bytes:
        return b"".join(self.piece(t) for t in tokens)

    def is_eog(self, token: int) -> bool:
        return token in self.info.eog

    aborts = True
    parks = True   # seq_export is bytes: --park can write it

    def decode(self, rows: list[BatchRow], abort: Callable[[], bool] | None = None) -> list[Any]:
        outs: list[Any] = []
        n_prefill = 0
        n_decode = 0
        n_drafted = 0
        before = {row.seq: len(self.kv[row.seq]) for row in rows}
        for row in rows:
            kv = self.kv[row.seq]
            if row.pos0 != len(kv):
                raise RuntimeError(f"mock: seq {row.seq} holds {len(kv)} tokens, decode starts at {row.pos0}")
            if row.pos0 + len(row.tokens) > self.info.n_ctx_seq:
                raise RuntimeError(f"mock: seq {row.seq} overflows its window")
            kv.extend(row.tokens)
            if row.all_logits and row.want_logits:
                n_decode += 1
                n_drafted += len(row.tokens) - 1
                outs.append([tuple(kv[:row.pos0 + j + 1]) for j in range(len(row.tokens))])
                continue
            if len(row.tokens) == 1 and row.want_logits:
                n_decode += 1
            else:
                n_prefill += len(row.tokens)
            outs.append(tuple(kv) if row.want_logits else None)
        cost = (n_prefill * self.opts["prefill_us"] / 1e6 + (self.opts["step_ms"] / 1e3 if n_decode else 0.0)
                + n_drafted * self.opts["draft_us"] / 1e6)
        end = time.monotonic() + cost
        while (left := end - time.monotonic()) > 0:
            if abort is not None and abort():
                for seq, n in before.items():
                    del self.kv[seq][n:]
                raise StepAborted
            time.sleep(min(left, ABORT_POLL_S) if abort is not None else left)
        return outs

    def keep_logits(self, out: Any) -> Any:
        """A row's "logits" kept past the next decode: the mock's are its context, immutable."""
        return out

    def new_sampler(self, sampling: Sampling, history: list[int]) -> _MockSampler:
        if sampling.grammar:
            raise ValueError("the mock runtime cannot apply a grammar")
        return _MockSampler(self, sampling)

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        kv = self.kv[seq]
        end = len(kv) if p1 < 0 else p1
        del kv[p0:end]
        return True

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        if self.kv[dst][:p0] != self.kv[src][:p0] or len(self.kv[dst]) != p0:
            raise RuntimeError("mock: seq_cp must continue the destination")
        end = len(self.kv[src]) if p1 < 0 else p1
        self.kv[dst].extend(self.kv[src][p0:end])

    def seq_export(self, seq: int) -> bytes:
        return array.array("I", self.kv[seq]).tobytes()

    def seq_import(self, seq: int, data: Any) -> bool:
        if self.kv[seq]:
            raise RuntimeError("mock: seq_import into a non-empty sequence")
        self.kv[seq] = array.array("I", bytes(data)).tolist()
        return True

    def close(self) -> None:
        self.kv = []


def open_engine(model: str, *, max_batch: int, max_context: int, threads: int,
                deterministic: bool = False) -> MockEngine:
    """The registry's entry point (``superfluid.runtime._registry``): every engine module has one."""
    return MockEngine(model, n_seq=max(4, max_batch + 2))
