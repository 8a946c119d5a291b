"""Generated from torchft.proto by grpc_tools.protoc (see Makefile target `proto`)."""
