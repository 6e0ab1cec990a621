"""Wire contracts of splitspec (`splitspec.v1`): the .proto files and their generated code."""
