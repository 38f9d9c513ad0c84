#!/usr/bin/env python3
"""A third-party gRPC client (Python grpcio) probing a tpserve coordinator or rank.

    grpc_probe.py TARGET health [SERVICE]   -> prints the serving status name
    grpc_probe.py TARGET list [v1|v1alpha]  -> prints the services listed by reflection, one per line
    grpc_probe.py TARGET malformed METHOD   -> sends bytes that are not a valid message (invalid
                                               UTF-8 in a string field); prints the status code

TARGET is host:port or unix:///path.
"""
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2


def channel(target):
    options = []
    if target.startswith("unix://"):
        # The default authority would be the socket path, which is not a valid :authority.
        options.append(("grpc.default_authority", "localhost"))
    return grpc.insecure_channel(target, options=options)


def health(target, service=""):
    stub = health_pb2_grpc.HealthStub(channel(target))
    response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


def list_services(target, version="v1"):
    # grpcio-reflection ships message classes for v1alpha only; grpc.reflection.v1 has the same
    # messages on the wire, so they serve for both method paths.
    method = f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo"
    call = channel(target).stream_stream(
        method,
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    responses = call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    for response in responses:
        for service in response.list_services_response.service:
            print(service.name)


def malformed(target, method):
    # Field 1 (a string in every request we probe) holding the bytes 0xff 0xfe: not UTF-8.
    payload = b"\x0a\x02\xff\xfe"
    call = channel(target).unary_unary(method, request_serializer=None, response_deserializer=None)
    try:
        call(payload, timeout=10)
        print("OK")
    except grpc.RpcError as err:
        print(err.code().name)


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    target, command, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    if command == "health":
        health(target, *args)
    elif command == "list":
        list_services(target, *args)
    elif command == "malformed":
        malformed(target, *args)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
