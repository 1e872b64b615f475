"""The encoder-decoder built from the decoder's blocks plus cross-attention (`model`), and the toy tasks it
learns (`tasks`: reverse, sort, add)."""
