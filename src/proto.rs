//! Generated protobuf and gRPC code (see proto/).

pub mod rank {
    pub mod v1 {
        tonic::include_proto!("tpserve.rank.v1");
    }
}

pub mod v1 {
    tonic::include_proto!("tpserve.v1");
}

/// Encoded FileDescriptorSet of every tpserve proto, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/tpserve_descriptor.bin"));

/// A grpc.health.v1 service name that coordinator and ranks report SERVING whenever the process
/// answers: for liveness probes, which must not restart a server that is only waiting (for its
/// ranks, or for a coordinator).
pub const LIVENESS_SERVICE: &str = "liveness";

/// The rank protocol version. Bumped on any incompatible change to rank.proto.
pub const RANK_PROTOCOL_VERSION: u32 = 2;

/// Server reflection (v1 and v1alpha) advertising exactly `services`, with the descriptors of
/// tpserve, grpc.health.v1 and reflection itself, so clients can call every advertised service.
pub fn reflection_services(
    services: &[&str],
) -> Result<
    (
        tonic_reflection::server::v1::ServerReflectionServer<impl tonic_reflection::server::v1::ServerReflection>,
        tonic_reflection::server::v1alpha::ServerReflectionServer<impl tonic_reflection::server::v1alpha::ServerReflection>,
    ),
    tonic_reflection::server::Error,
> {
    let mut services: Vec<&str> = services.to_vec();
    services.extend(["grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"]);
    let builder = || {
        let mut builder = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET)
            .include_reflection_service(false);
        for service in &services {
            builder = builder.with_service_name(*service);
        }
        builder
    };
    Ok((builder().build_v1()?, builder().build_v1alpha()?))
}
