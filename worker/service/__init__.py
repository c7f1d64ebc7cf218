"""The worker's service side: the rq job, event streaming, fleet registry, recovery, runner."""
