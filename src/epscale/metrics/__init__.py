"""Training metrics: step-time sections, MoE routing statistics reduced across ranks in
one collective, and the sinks that write them (metrics.jsonl, TensorBoard, Prometheus).

The trainer's side of the metrics.jsonl contract, in four calls::

    from epscale.metrics import StepTimers, StepStatsCollector, MetricsWriter, flops_per_token

    timers = StepTimers(device)
    stats = StepStatsCollector(model, ep=dims.ep, flops_per_token=flops_per_token(cfg))
    stats.attach_timer(timers)                       # moe.timer = timers.section
    writer = MetricsWriter.open(run_dir, rank=rank)  # no-op on ranks != 0
    ...
    rec = stats.record(step, step_time_s=dt, num_tokens=n, loss=loss, lr=lr,
                       grad_norm=gn, breakdown=timers.breakdown())   # all ranks call
    writer.write(rec)
"""

from .flops import flops_per_token, mfu, peak_flops
from .balance import RunningMaxVio, max_vio, rank_idle, rank_loads
from .moe_stats import StepStatsCollector
from .sinks import JsonlSink, MetricsWriter, PrometheusSink, Sink, TensorBoardSink
from .timers import COMM_SECTIONS, STANDARD_SECTIONS, StepTimers, comm_share

__all__ = [
    "StepTimers", "STANDARD_SECTIONS", "COMM_SECTIONS", "comm_share",
    "StepStatsCollector", "RunningMaxVio", "max_vio", "rank_idle", "rank_loads",
    "MetricsWriter", "Sink", "JsonlSink", "TensorBoardSink", "PrometheusSink",
    "flops_per_token", "peak_flops", "mfu",
]
