"""Reading and editing ONNX files in their protobuf wire format, without the ``onnx`` package
(an export-only dependency): :mod:`.scan` lists operators and graph I/O, :mod:`.edit` rewrites
a main graph's nodes and external-data references."""
