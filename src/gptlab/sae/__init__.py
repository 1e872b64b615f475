"""Sparse autoencoders on a run's activations: the TopK model (`model`), its settings (`config`), activations
streamed from the run's data (`data`), training (`training`), metrics with the SAE spliced in (`metrics`),
the feature page (`page`), files SAELens loads (`export`) and the planted-feature toy (`toy`)."""
