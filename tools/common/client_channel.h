// How the command-line clients (coalesce-cli, coalesce-bench, coalesce-eval)
// reach a server: plaintext, TLS or mutual TLS, with or without an API key,
// from the same flags in each (defined in client_channel.cc):
//   --tls_ca_file, --tls_cert_file, --tls_key_file   (docs/configuration.md,
//                                                     "Transport security")
//   --api_key_file, or the environment variable COALESCE_API_KEY
//                                                    ("Tenants and API keys")
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace coalesce::tools {

struct ClientTls {
  std::string ca_file;    // PEM roots that sign the server's certificate
  std::string cert_file;  // PEM certificate chain of this client (mutual TLS)
  std::string key_file;   // its private key
};

// Plaintext when no file is given; TLS when any is (the system's roots
// unless ca_file), presenting a client certificate when cert_file and
// key_file are given (both or neither). An error names the flag.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const ClientTls& tls);

// The API key: the first line of `file` without surrounding whitespace, or,
// without a file, the environment variable COALESCE_API_KEY; empty: none.
// An error names the flag (an unreadable or empty file).
absl::StatusOr<std::string> ApiKeyFrom(const std::string& file);

// A channel to `server` with the credentials and API key of the flags
// above: every call it makes carries `authorization: Bearer KEY` when there
// is a key. An error names the flag.
absl::StatusOr<std::shared_ptr<grpc::Channel>> ClientChannelFromFlags(
    const std::string& server, const grpc::ChannelArguments& args = {});

}  // namespace coalesce::tools
