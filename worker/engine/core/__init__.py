"""The engine's leaf types: drafts and verify outcomes, distributions, what a slot's constraint
and sampler answer, and the counters a generation keeps. Everything in ``worker/engine``
may import them; they import nothing of the engine above them."""
