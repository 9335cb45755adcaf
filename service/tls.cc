#include "service/tls.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <algorithm>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/read_file.h"
#include "common/status_macros.h"
#include "grpc/grpc.h"
#include "grpcpp/security/server_credentials.h"

namespace coalesce::service {
namespace {

// A PEM file's text, or an error naming the flag.
absl::StatusOr<std::string> ReadPem(const std::string& path, const char* flag) {
  absl::StatusOr<std::string> text = ReadFile(path, flag);
  if (text.ok() && text->empty()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, "=", path, ": empty"));
  }
  return text;
}

struct BioDeleter {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Deleter {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyDeleter {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};

std::unique_ptr<BIO, BioDeleter> Bio(const std::string& pem) {
  return std::unique_ptr<BIO, BioDeleter>(
      BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// The PEM's first certificate, when every certificate in it parses (a chain
// or a bundle cut short in its second certificate is no use either);
// otherwise null.
std::unique_ptr<X509, X509Deleter> FirstCertificate(const std::string& pem) {
  auto bio = Bio(pem);
  std::unique_ptr<X509, X509Deleter> first(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  if (first == nullptr) return nullptr;
  while (std::unique_ptr<X509, X509Deleter>(
             PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) != nullptr) {
  }
  // The end of the text ends the loop with "no start line"; anything else
  // is a certificate that does not parse.
  const unsigned long error = ERR_peek_last_error();
  if (ERR_GET_LIB(error) != ERR_LIB_PEM || ERR_GET_REASON(error) != PEM_R_NO_START_LINE) {
    return nullptr;
  }
  return first;
}

// The certificate chain and its key: both PEM, the key the first
// certificate's. Errors name the flags and files.
absl::Status CheckIdentity(const TlsFiles& files, const std::string& cert, const std::string& key) {
  ERR_clear_error();
  auto x509 = FirstCertificate(cert);
  if (x509 == nullptr) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_cert_file=", files.cert, ": no PEM certificate in it, or one that does not parse"));
  }
  auto key_bio = Bio(key);
  std::unique_ptr<EVP_PKEY, KeyDeleter> pkey(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  if (pkey == nullptr) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_key_file=", files.key, ": no PEM private key in it (or one with a passphrase)"));
  }
  if (X509_check_private_key(x509.get(), pkey.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key_file=", files.key,
                     " is not the key of --tls_cert_file=", files.cert, "'s certificate"));
  }
  ERR_clear_error();
  return absl::OkStatus();
}

absl::Status CheckClientCa(const TlsFiles& files, const std::string& ca) {
  ERR_clear_error();
  const bool parsed = FirstCertificate(ca) != nullptr;
  ERR_clear_error();
  if (!parsed) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_client_ca_file=", files.client_ca,
                     ": no PEM certificate in it, or one that does not parse"));
  }
  return absl::OkStatus();
}

// What a read gave, for telling whether the files changed since the last
// look: their text, or why they could not be read.
std::string Seen(const absl::StatusOr<std::string>& text) {
  return text.ok() ? absl::StrCat("+", *text) : absl::StrCat("-", text.status().message());
}

std::string TimeForLog(absl::Time t) {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", t, absl::UTCTimeZone());
}

// gRPC's SSL server credentials whose certificates come from a callback
// (grpc_ssl_server_credentials_create_options_using_config_fetcher), as
// grpc::ServerCredentials. gRPC's C++ API has no such wrapper; the C
// credentials are added to a port as any others are.
class FetchingServerCredentials final : public grpc::ServerCredentials {
 public:
  FetchingServerCredentials(grpc_ssl_client_certificate_request_type request,
                            grpc_ssl_server_certificate_config_callback fetch, void* user_data) {
    // After the base class has initialized gRPC.
    creds_ = grpc_ssl_server_credentials_create_with_options(
        grpc_ssl_server_credentials_create_options_using_config_fetcher(request, fetch, user_data));
  }
  ~FetchingServerCredentials() override { grpc_server_credentials_release(creds_); }

  // coalesce authenticates calls itself (service/tenants.h).
  void SetAuthMetadataProcessor(const std::shared_ptr<grpc::AuthMetadataProcessor>&) override {
    Log(LogLevel::kError, "TLS: an auth metadata processor is not supported here");
  }

 private:
  int AddPortToServer(const std::string& addr, grpc_server* server) override {
    return grpc_server_add_http2_port(server, addr.c_str(), creds_);
  }

  grpc_server_credentials* creds_ = nullptr;
};

}  // namespace

absl::Status CheckTlsFiles(const TlsFiles& files) {
  if (files.cert.empty() != files.key.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert_file and --tls_key_file go together: give both for TLS, or neither for "
        "plaintext");
  }
  if (files.cert.empty()) {
    if (!files.client_ca.empty()) {
      return absl::InvalidArgumentError(
          "--tls_client_ca_file needs --tls_cert_file and --tls_key_file: mutual TLS is TLS "
          "first");
    }
    return absl::OkStatus();
  }
  if (files.reload_interval < absl::Seconds(1)) {
    return absl::InvalidArgumentError("--tls_reload_interval must be at least 1s");
  }
  ASSIGN_OR_RETURN(const std::string cert, ReadPem(files.cert, "--tls_cert_file"));
  ASSIGN_OR_RETURN(const std::string key, ReadPem(files.key, "--tls_key_file"));
  RETURN_IF_ERROR(CheckIdentity(files, cert, key));
  if (!files.client_ca.empty()) {
    ASSIGN_OR_RETURN(const std::string ca, ReadPem(files.client_ca, "--tls_client_ca_file"));
    RETURN_IF_ERROR(CheckClientCa(files, ca));
  }
  return absl::OkStatus();
}

std::string TlsModeName(const TlsFiles& files) {
  if (files.cert.empty()) return "plaintext";
  return files.client_ca.empty() ? "TLS" : "mutual TLS";
}

absl::StatusOr<std::unique_ptr<TlsCredentials>> TlsCredentials::Start(const TlsFiles& files) {
  std::unique_ptr<TlsCredentials> t(new TlsCredentials(files));
  if (files.cert.empty()) {
    t->credentials_ = grpc::InsecureServerCredentials();
    return t;
  }
  RETURN_IF_ERROR(CheckTlsFiles(files));
  absl::StatusOr<std::string> cert = ReadPem(files.cert, "--tls_cert_file");
  absl::StatusOr<std::string> key = ReadPem(files.key, "--tls_key_file");
  absl::StatusOr<std::string> ca = std::string();
  if (!files.client_ca.empty()) ca = ReadPem(files.client_ca, "--tls_client_ca_file");
  // The files may change between the check and here: check what was read.
  RETURN_IF_ERROR(cert.status());
  RETURN_IF_ERROR(key.status());
  RETURN_IF_ERROR(ca.status());
  RETURN_IF_ERROR(CheckIdentity(files, *cert, *key));
  if (!files.client_ca.empty()) RETURN_IF_ERROR(CheckClientCa(files, *ca));
  {
    absl::MutexLock lock(&t->mu_);
    t->served_ = {*cert, *key, *ca};
    t->version_ = 1;
  }
  t->identity_seen_ = Seen(cert) + Seen(key);
  t->client_ca_seen_ = Seen(ca);
  t->identity_since_ = t->client_ca_since_ = absl::Now();
  t->credentials_ = std::make_shared<FetchingServerCredentials>(
      files.client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                              : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY,
      &TlsCredentials::FetchConfig, t.get());
  t->thread_ = std::thread([self = t.get()] { self->Run(); });
  return t;
}

TlsCredentials::~TlsCredentials() {
  if (thread_.joinable()) {
    stop_.Notify();
    thread_.join();
  }
}

void TlsCredentials::Run() {
  while (!stop_.WaitForNotificationWithTimeout(files_.reload_interval)) Reload();
}

bool TlsCredentials::Serve(
    std::initializer_list<std::pair<std::string Material::*, const std::string*>> parts) {
  absl::MutexLock lock(&mu_);
  bool changed = false;
  for (const auto& [field, text] : parts) {
    if (served_.*field != *text) {
      served_.*field = *text;
      changed = true;
    }
  }
  if (changed) ++version_;
  return changed;
}

void TlsCredentials::Reload() {
  const absl::StatusOr<std::string> cert = ReadPem(files_.cert, "--tls_cert_file");
  const absl::StatusOr<std::string> key = ReadPem(files_.key, "--tls_key_file");
  if (std::string seen = Seen(cert) + Seen(key); seen != identity_seen_) {
    identity_seen_ = std::move(seen);
    absl::Status usable = cert.status();
    if (usable.ok()) usable = key.status();
    if (usable.ok()) usable = CheckIdentity(files_, *cert, *key);
    if (!usable.ok()) {
      LogF(LogLevel::kWarning,
           "TLS: --tls_cert_file and --tls_key_file changed, but not into a pair that can be "
           "served (%s); new connections still get the certificate loaded at %s",
           usable.message(), TimeForLog(identity_since_));
    } else if (Serve({{&Material::cert, &*cert}, {&Material::key, &*key}})) {
      identity_since_ = absl::Now();
      LogF(LogLevel::kInfo, "TLS: new connections get the certificate now in --tls_cert_file=%s",
           files_.cert);
    }
  }
  if (files_.client_ca.empty()) return;
  const absl::StatusOr<std::string> ca = ReadPem(files_.client_ca, "--tls_client_ca_file");
  if (std::string seen = Seen(ca); seen != client_ca_seen_) {
    client_ca_seen_ = std::move(seen);
    const absl::Status usable = ca.ok() ? CheckClientCa(files_, *ca) : ca.status();
    if (!usable.ok()) {
      LogF(LogLevel::kWarning,
           "TLS: --tls_client_ca_file changed, but not into a CA bundle that can be used (%s); "
           "client certificates are still checked against the one loaded at %s",
           usable.message(), TimeForLog(client_ca_since_));
    } else if (Serve({{&Material::client_ca, &*ca}})) {
      client_ca_since_ = absl::Now();
      LogF(LogLevel::kInfo,
           "TLS: client certificates are now checked against the CA bundle now in "
           "--tls_client_ca_file=%s",
           files_.client_ca);
    }
  }
}

// gRPC calls this when it builds the port's TLS context (at start-up) and
// then at every new handshake; a NEW config replaces the context for the
// handshakes that follow (a config gRPC cannot use is logged by gRPC, and the
// context it had kept). The port is the only user of these credentials, so
// "handed" is the port's state.
grpc_ssl_certificate_config_reload_status TlsCredentials::FetchConfig(
    void* self_arg, grpc_ssl_server_certificate_config** config) {
  auto* self = static_cast<TlsCredentials*>(self_arg);
  absl::MutexLock lock(&self->mu_);
  if (self->handed_ == self->version_) return GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_UNCHANGED;
  self->handed_ = self->version_;
  const grpc_ssl_pem_key_cert_pair pair = {self->served_.key.c_str(), self->served_.cert.c_str()};
  // gRPC requires roots to verify clients by in a config it fetches, even
  // when it requests no client certificate (and so verifies none): without
  // a client CA the server's own chain stands in, unused. Copies the strings.
  const std::string& roots =
      self->served_.client_ca.empty() ? self->served_.cert : self->served_.client_ca;
  *config = grpc_ssl_server_certificate_config_create(roots.c_str(), &pair, 1);
  return GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_NEW;
}

}  // namespace coalesce::service
