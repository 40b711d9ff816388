"""benchmarks/decode_cpu.py: TPOT and inter-token gaps from a streamed request's arrival times (no server)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import decode_cpu  # noqa: E402


class FakeClient:
    """Streams one chunk per token at the given times (seconds after the request), then the usage chunk."""

    def __init__(self, times: list[float], prompt_tokens: int = 100):
        self.times, self.prompt_tokens, self.kwargs = times, prompt_tokens, None
        self.chat = NS(completions=NS(create=self._create))

    def _create(self, **kwargs):
        self.kwargs = kwargs
        clock = iter(self.times)

        def chunks():
            for _ in self.times:
                self.now = next(clock)
                yield NS(usage=None, choices=[NS(delta=NS(content="x"))])
            yield NS(usage=NS(completion_tokens=len(self.times), prompt_tokens=self.prompt_tokens), choices=[])

        return chunks()


def test_tpot_and_gaps_come_from_the_arrival_times(monkeypatch):
    times = [2.0, 2.1, 2.2, 2.5, 2.6]  # TTFT 2 s, then gaps 0.1, 0.1, 0.3, 0.1
    client = FakeClient(times)
    monkeypatch.setattr(decode_cpu.time, "perf_counter", lambda: getattr(client, "now", 0.0))
    r = decode_cpu.timed_stream(client, "m", [{"role": "user", "content": "q"}], new_tokens=5)
    assert r["ttft_s"] == pytest.approx(2.0)
    assert r["tpot_ms"] == pytest.approx(150.0)  # 0.6 s over the 4 tokens after the first
    assert r["median_itl_ms"] == pytest.approx(100.0)
    assert r["p90_itl_ms"] == pytest.approx(100.0)  # index int(0.9 * 3) = 2 of [0.1, 0.1, 0.1, 0.3]
    assert r["completion_tokens"] == 5 and r["prompt_tokens"] == 100 and r["streamed_chunks"] == 5
    # exactly new_tokens forced: greedy, no early stop at the end-of-sequence token
    assert client.kwargs["max_tokens"] == 5 and client.kwargs["temperature"] == 0.0
    assert client.kwargs["extra_body"] == {"ignore_eos": True, "min_tokens": 5}


def test_one_token_has_no_tpot(monkeypatch):
    client = FakeClient([1.0])
    monkeypatch.setattr(decode_cpu.time, "perf_counter", lambda: getattr(client, "now", 0.0))
    r = decode_cpu.timed_stream(client, "m", [], new_tokens=1)
    assert r["ttft_s"] == pytest.approx(1.0) and r["tpot_ms"] is None and r["median_itl_ms"] is None
