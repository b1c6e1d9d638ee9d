"""``qwen35-onnx bench``: speed side by side with the peers (:mod:`.speed`; the peers in
:mod:`.peers` and :mod:`.ovgenai_peer`, the protocol in :mod:`.protocol`, the report in
:mod:`.report`) and resident memory with every graph loaded (:mod:`.memory`)."""
