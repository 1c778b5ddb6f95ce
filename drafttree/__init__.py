"""drafttree: lossless speculative decoding with draft trees."""

__version__ = "0.1.0"
