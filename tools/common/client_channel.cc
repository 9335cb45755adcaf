#include "tools/common/client_channel.h"

#include <cstdlib>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/read_file.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/support/client_interceptor.h"

ABSL_FLAG(std::string, tls_ca_file, "",
          "PEM roots to verify the server's certificate: connect over TLS.");
ABSL_FLAG(std::string, tls_cert_file, "", "PEM client certificate chain, for mutual TLS.");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file.");
ABSL_FLAG(std::string, api_key_file, "",
          "File holding the API key sent as 'authorization: Bearer KEY' (a server with "
          "--api_keys_file); without it, the environment variable COALESCE_API_KEY, if set.");

namespace coalesce::tools {
namespace {

// Adds the authorization header to every call of the channel.
class BearerInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit BearerInterceptor(const std::string* header) : header_(header) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->emplace("authorization", *header_);
    }
    methods->Proceed();
  }

 private:
  const std::string* header_;
};

class BearerInterceptorFactory : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerInterceptorFactory(const std::string& key) : header_("Bearer " + key) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo* /*info*/) override {
    return new BearerInterceptor(&header_);
  }

 private:
  const std::string header_;  // lives as long as the channel, which owns the factory
};

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
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

absl::StatusOr<std::string> ApiKeyFrom(const std::string& file) {
  if (file.empty()) {
    const char* env = std::getenv("COALESCE_API_KEY");
    return std::string(absl::StripAsciiWhitespace(env == nullptr ? "" : env));
  }
  absl::StatusOr<std::string> text = ReadFile(file, "--api_key_file", 64 << 10);
  if (!text.ok()) return text.status();
  std::string key(absl::StripAsciiWhitespace(text->substr(0, text->find('\n'))));
  if (key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--api_key_file=", file, ": no key in it"));
  }
  return key;
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> ClientChannelFromFlags(
    const std::string& server, const grpc::ChannelArguments& args) {
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      ChannelCredentialsFor({absl::GetFlag(FLAGS_tls_ca_file), absl::GetFlag(FLAGS_tls_cert_file),
                             absl::GetFlag(FLAGS_tls_key_file)});
  if (!credentials.ok()) return credentials.status();
  absl::StatusOr<std::string> key = ApiKeyFrom(absl::GetFlag(FLAGS_api_key_file));
  if (!key.ok()) return key.status();
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  if (!key->empty()) interceptors.push_back(std::make_unique<BearerInterceptorFactory>(*key));
  return grpc::experimental::CreateCustomChannelWithInterceptors(server, *credentials, args,
                                                                 std::move(interceptors));
}

}  // namespace coalesce::tools
