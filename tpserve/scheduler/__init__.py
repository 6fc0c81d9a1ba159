"""Scheduling: sequences, the scheduler (admission, prefill/decode, preemption), plan building."""
from tpserve.scheduler.plan_builder import SlotTable, build_plan
from tpserve.scheduler.scheduler import ScheduledBatch, Scheduler
from tpserve.scheduler.sequence import Sequence, SequenceStatus

__all__ = ["ScheduledBatch", "Scheduler", "Sequence", "SequenceStatus", "SlotTable", "build_plan"]
