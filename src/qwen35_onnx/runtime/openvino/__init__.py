"""The OpenVINO backend, whole: static compilation and checks (:mod:`.backend`) and the A/B
infer-request decoders (:mod:`.decoders`)."""
