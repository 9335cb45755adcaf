# Every test_*.py here: the real server binary, driven by a Python grpcio client
# (Debian's). test_hf_server_parity.py and test_gguf_server_parity.py need
# torch and transformers: the venv.
# Under ThreadSanitizer (tools/tsan.sh) the server runs several times slower:
# the whole folder takes about 9 minutes on 2 cores, so it gets 20.
set(_e2e_timeout 600)
if(CMAKE_CXX_FLAGS MATCHES "-fsanitize=thread")
  set(_e2e_timeout 1200)
endif()
add_test(NAME service_e2e
         COMMAND /usr/bin/python3 -m pytest -q -p no:cacheprovider
                 --ignore=${CMAKE_CURRENT_SOURCE_DIR}/test_hf_server_parity.py
                 --ignore=${CMAKE_CURRENT_SOURCE_DIR}/test_gguf_server_parity.py
                 ${CMAKE_CURRENT_SOURCE_DIR})
set_tests_properties(service_e2e PROPERTIES ${COALESCE_PYTEST_NO_SKIPS}
  ENVIRONMENT "COALESCE_SERVER=$<TARGET_FILE:coalesce-server>;COALESCE_MODELS_DIR=${COALESCE_MODELS_DIR}"
  TIMEOUT ${_e2e_timeout})

add_test(NAME hf_server_parity
         COMMAND ${COALESCE_PYTHON} -m pytest -q -p no:cacheprovider
                 ${CMAKE_CURRENT_SOURCE_DIR}/test_hf_server_parity.py)
set_tests_properties(hf_server_parity PROPERTIES ${COALESCE_PYTEST_NO_SKIPS}
  ENVIRONMENT "COALESCE_SERVER=$<TARGET_FILE:coalesce-server>;COALESCE_MODELS_DIR=${COALESCE_MODELS_DIR}"
  TIMEOUT 600)

# SmolLM2-135M-Instruct from its GGUF through the server against transformers
# loading the same file; fetches the model once into COALESCE_MODEL_CACHE.
add_test(NAME gguf_server_parity
         COMMAND ${COALESCE_PYTHON} -m pytest -q -p no:cacheprovider
                 ${CMAKE_CURRENT_SOURCE_DIR}/test_gguf_server_parity.py)
set_tests_properties(gguf_server_parity PROPERTIES ${COALESCE_PYTEST_NO_SKIPS}
  ENVIRONMENT "COALESCE_SERVER=$<TARGET_FILE:coalesce-server>;COALESCE_MODELS_DIR=${COALESCE_MODELS_DIR};COALESCE_GGUF_CACHE=${COALESCE_MODEL_CACHE}"
  TIMEOUT 900)
