// Transport security of the gRPC port: plaintext, TLS, or mutual TLS, with
// the certificate, key and client CA re-read from their files while the
// server runs (cert-manager rewrites them in place), no restart and no
// dropped connection: a new handshake takes what the files hold then, once
// they hold something usable.
//
// gRPC's own file watcher hands whatever the files hold to the next
// handshake: a certificate rewritten before its key, a file half written,
// garbage or a deleted file, and every new handshake failed until the files
// were right again. Here the files are checked first (PEM, the key matching
// the certificate), and a change that is not usable is logged while
// handshakes keep the last usable pair (and CA bundle).
#pragma once

#include <initializer_list>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "grpc/grpc_security.h"
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

// "plaintext", "TLS" or "mutual TLS", for the start-up log.
std::string TlsModeName(const TlsFiles& files);

// The gRPC port's credentials, and for TLS the watcher of its files. gRPC
// asks it for the certificate at every new handshake, so it must outlive the
// gRPC server it is given to.
class TlsCredentials {
 public:
  // Plaintext when files.cert is empty. Otherwise reads and checks the files
  // (an error is CheckTlsFiles's) and looks at them again every
  // files.reload_interval on a thread of its own.
  static absl::StatusOr<std::unique_ptr<TlsCredentials>> Start(const TlsFiles& files);
  ~TlsCredentials();

  std::shared_ptr<grpc::ServerCredentials> credentials() const { return credentials_; }

 private:
  // What the next handshake gets: checked PEM text.
  struct Material {
    std::string cert, key, client_ca;
  };

  explicit TlsCredentials(const TlsFiles& files) : files_(files) {}
  // Reads the files; a usable change is served, an unusable one logged
  // (once per content).
  void Reload();
  // Makes each part of what is served the text given for it; whether any
  // changed (and so the next handshake gets a new config).
  bool Serve(std::initializer_list<std::pair<std::string Material::*, const std::string*>> parts);
  void Run();
  // gRPC's certificate config callback (grpc_security.h), at each handshake.
  static grpc_ssl_certificate_config_reload_status FetchConfig(
      void* self, grpc_ssl_server_certificate_config** config);

  const TlsFiles files_;
  std::shared_ptr<grpc::ServerCredentials> credentials_;
  absl::Mutex mu_;
  Material served_ ABSL_GUARDED_BY(mu_);
  // Bumped at each change of served_; gRPC has been handed handed_.
  int version_ ABSL_GUARDED_BY(mu_) = 0;
  int handed_ ABSL_GUARDED_BY(mu_) = 0;
  // Touched by the watcher thread only: when each part was last served, and
  // what was last read (contents, or why they could not be read), so that
  // the same unusable files are reported once.
  absl::Time identity_since_, client_ca_since_;
  std::string identity_seen_, client_ca_seen_;
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace coalesce::service
