"""EngineCollector on a real engine: pages, counters and fragmentation read between two steps."""

from __future__ import annotations

import torch

from kvtierd.engine.sampling_params import SamplingParams
from kvtierd.server.engine_metrics import EngineCollector
from kvtierd.server.state import ServerCounters


def samples(collector: EngineCollector) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in collector.collect() for s in f.samples}


def test_a_prefilled_request_shows_its_pages_and_the_unused_slots_of_its_last_page(make_engine):
    engine = make_engine(block_size=4, kv_tokens=64)  # 16 pages of 4 tokens
    engine.add_request(list(range(100, 106)), SamplingParams(max_tokens=8, temperature=0.0))  # 6 tokens
    engine.step()  # prefill: 2 pages, 6 of their 8 slots hold tokens
    m = samples(EngineCollector(engine, ServerCounters(errors_4xx=3), uptime_s=5.0))

    device = (("tier", "device"),)
    assert m[("kvtierd_page_fragmentation_ratio", ())] == 2 / 8
    assert m[("kvtierd_pages", (("state", "used"), ("tier", "device")))] == 2
    assert m[("kvtierd_pages", (("state", "free"), ("tier", "device")))] == 14
    assert m[("kvtierd_pages_capacity", device)] == 16
    assert m[("kvtierd_engine_requests", (("state", "running"),))] == 1
    assert (m[("kvtierd_requests_total", ())], m[("kvtierd_prompt_tokens_total", ())]) == (1, 6)
    assert m[("kvtierd_generated_tokens_total", ())] == 1
    assert m[("kvtierd_engine_last_step_tokens", ())] == 6
    assert m[("kvtierd_engine_last_step_threads", ())] == torch.get_num_threads()  # no tiers: every thread
    assert m[("kvtierd_http_errors_total", (("status_class", "4xx"),))] == 3
    assert m[("kvtierd_uptime_seconds", ())] == 5.0
