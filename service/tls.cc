#include "service/tls.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <algorithm>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/read_file.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"

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

// The PEM's first certificate.
std::unique_ptr<X509, X509Deleter> FirstCertificate(const std::string& pem) {
  auto bio = Bio(pem);
  return std::unique_ptr<X509, X509Deleter>(
      PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
}

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
  ERR_clear_error();
  absl::StatusOr<std::string> cert = ReadPem(files.cert, "--tls_cert_file");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem(files.key, "--tls_key_file");
  if (!key.ok()) return key.status();
  auto x509 = FirstCertificate(*cert);
  if (x509 == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_cert_file=", files.cert, ": no PEM certificate in it"));
  }
  auto key_bio = Bio(*key);
  std::unique_ptr<EVP_PKEY, KeyDeleter> pkey(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  if (pkey == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_key_file=", files.key, ": no PEM private key in it (or one with a passphrase)"));
  }
  if (X509_check_private_key(x509.get(), pkey.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key_file=", files.key,
                     " is not the key of --tls_cert_file=", files.cert, "'s certificate"));
  }
  if (!files.client_ca.empty()) {
    absl::StatusOr<std::string> ca = ReadPem(files.client_ca, "--tls_client_ca_file");
    if (!ca.ok()) return ca.status();
    if (FirstCertificate(*ca) == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tls_client_ca_file=", files.client_ca, ": no PEM certificate in it"));
    }
  }
  ERR_clear_error();
  return absl::OkStatus();
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentialsFor(const TlsFiles& files) {
  if (files.cert.empty()) return grpc::InsecureServerCredentials();
  const auto interval =
      static_cast<unsigned int>(std::max<int64_t>(1, absl::ToInt64Seconds(files.reload_interval)));
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      files.key, files.cert, files.client_ca, interval);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (files.client_ca.empty()) {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

std::string TlsModeName(const TlsFiles& files) {
  if (files.cert.empty()) return "plaintext";
  return files.client_ca.empty() ? "TLS" : "mutual TLS";
}

}  // namespace coalesce::service
