"""``qwen35-onnx serve``, split as llama.cpp's server is: the OpenAI protocol without HTTP
(:mod:`.protocol`), scheduling of generations on one worker thread (:mod:`.scheduler`) and the
HTTP application and its routes (:mod:`.app`)."""
