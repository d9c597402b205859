"""inferd's own descriptor pool for the `inference.*` messages.

Triton's client (tritonclient.grpc) registers grpc_service.proto and model_config.proto, with the
same `inference.*` full names, in protobuf's default pool. Registering ours there too would fail
("duplicate symbol") or shadow the client's classes whenever both live in one process (tests,
a gateway that also calls other Triton servers). So our messages live in a private pool built from
the FileDescriptorSet that scripts/gen_protos.sh serialized into `_descriptors.py`; the wire format
is identical, only the Python classes differ.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper
from google.protobuf.message import Message

from inferd.gateway.kserve.proto._descriptors import FILE_DESCRIPTOR_SET

POOL = descriptor_pool.DescriptorPool()
# The set lists files in dependency order (protoc --include_imports), as Add requires.
for _file in descriptor_pb2.FileDescriptorSet.FromString(FILE_DESCRIPTOR_SET).file:
    POOL.Add(_file)


def message(full_name: str) -> type[Message]:
    """The message class for `full_name` (e.g. "inference.ModelInferRequest") in our pool."""
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(full_name))


def enum(full_name: str) -> EnumTypeWrapper:
    """The enum wrapper (Name/Value lookups) for a top-level enum in our pool."""
    return EnumTypeWrapper(POOL.FindEnumTypeByName(full_name))
