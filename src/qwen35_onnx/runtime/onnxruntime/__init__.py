"""The ONNX Runtime backend, whole: sessions and the graph set (:mod:`.sessions`), IOBinding
decoders (:mod:`.decoders`), one copy of the weights for every session (:mod:`.shared_weights`,
:mod:`.prepacked`) and the backend itself (:mod:`.backend`)."""
