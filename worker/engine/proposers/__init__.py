"""Drafters: one proposer a module behind :class:`worker.engine.proposers.base.Proposer`."""
