// The channel credentials of the command-line clients (coalesce-cli,
// coalesce-bench): plaintext, TLS, or mutual TLS, from the same three flags
// in each (--tls_ca_file, --tls_cert_file, --tls_key_file).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/read_file.h"
#include "grpcpp/security/credentials.h"

namespace coalesce::tools {

struct ClientTls {
  std::string ca_file;    // PEM roots that sign the server's certificate
  std::string cert_file;  // PEM certificate chain of this client (mutual TLS)
  std::string key_file;   // its private key
};

// Plaintext when no file is given; TLS when any is (the system's roots
// unless ca_file), presenting a client certificate when cert_file and
// key_file are given (both or neither). An error names the flag.
inline absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const ClientTls& tls) {
  if (tls.ca_file.empty() && tls.cert_file.empty() && tls.key_file.empty()) {
    return grpc::InsecureChannelCredentials();
  }
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert_file and --tls_key_file go together");
  }
  auto read = [](const std::string& path, const char* flag) -> absl::StatusOr<std::string> {
    if (path.empty()) return std::string();
    return ReadFile(path, flag);
  };
  grpc::SslCredentialsOptions options;
  absl::StatusOr<std::string> ca = read(tls.ca_file, "--tls_ca_file");
  if (!ca.ok()) return ca.status();
  absl::StatusOr<std::string> cert = read(tls.cert_file, "--tls_cert_file");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = read(tls.key_file, "--tls_key_file");
  if (!key.ok()) return key.status();
  options.pem_root_certs = *ca;
  options.pem_cert_chain = *cert;
  options.pem_private_key = *key;
  return grpc::SslCredentials(options);
}

}  // namespace coalesce::tools
