"""Look inside a trained model (handout §2.2): hook points, attention maps, ablations, interventions, checks.

- `hooks`: named hook points on intermediate values, registered by a context manager that always
  removes them; attention weights recomputed beside the fast kernel, for the layers and heads asked for.
- `attention_view`: attention weights of a prompt as a PNG grid or an interactive, offline HTML page.
- `cross_attention`: an encoder-decoder's cross-attention: where each answer token read the source.
- `interventions`: remove heads or edit the prompt, and measure the prediction (the causal test).
"""
