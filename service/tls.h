// Transport security of the gRPC port: plaintext, TLS, or mutual TLS, with
// the certificate, key and client CA re-read from their files while the
// server runs (cert-manager rewrites them in place), no restart and no
// dropped connection: a new handshake takes what the files hold then.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/security/server_credentials.h"

namespace coalesce::service {

struct TlsFiles {
  std::string cert;       // PEM certificate chain; empty: plaintext
  std::string key;        // PEM private key of its first certificate
  std::string client_ca;  // PEM CA bundle: clients must present a certificate it signed
  // How often the files are looked at for a change.
  absl::Duration reload_interval = absl::Seconds(10);
};

// Checks what the flags name, before the server starts: cert and key both
// or neither, a client CA only with them, each file readable and parsed as
// PEM, the key matching the certificate. INVALID_ARGUMENT naming the flag
// and the problem; OK for plaintext.
absl::Status CheckTlsFiles(const TlsFiles& files);

// Plaintext credentials when files.cert is empty; otherwise TLS that watches
// the files (and requires and verifies client certificates with a client
// CA). Call CheckTlsFiles first.
std::shared_ptr<grpc::ServerCredentials> ServerCredentialsFor(const TlsFiles& files);

// "plaintext", "TLS" or "mutual TLS", for the start-up log.
std::string TlsModeName(const TlsFiles& files);

}  // namespace coalesce::service
