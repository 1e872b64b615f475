"""Checks a learner's own implementation of handout #11 (attention, heads, block, model) against it."""
