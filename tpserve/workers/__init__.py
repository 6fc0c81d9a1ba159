"""Tensor-parallel workers: runners, sampler, the StepPlan channel, process groups, the worker body."""
