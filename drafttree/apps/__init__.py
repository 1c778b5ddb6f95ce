"""The apps built on the speculation core: the command line (`cli`), the demo, the OpenAI-compatible server
(`serve`) and the benchmarks (`bench`). The core never imports them (tests/test_package_layers.py)."""
