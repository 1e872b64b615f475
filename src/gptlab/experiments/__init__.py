"""Experiments: a grid of training runs over seeds (`grid`), trained and resumed together (`runner`), and
reported with their noise (`report`), for `gptlab compare`."""
