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

/// The rank protocol version. Bumped on any incompatible change to rank.proto.
pub const RANK_PROTOCOL_VERSION: u32 = 1;
