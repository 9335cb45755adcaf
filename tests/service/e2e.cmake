# Every test_*.py here: the real server binary, driven by a Python grpcio client
# (Debian's). test_hf_server_parity.py needs torch and transformers: the venv.
add_test(NAME service_e2e
         COMMAND /usr/bin/python3 -m pytest -q -p no:cacheprovider
                 --ignore=${CMAKE_CURRENT_SOURCE_DIR}/test_hf_server_parity.py
                 ${CMAKE_CURRENT_SOURCE_DIR})
set_tests_properties(service_e2e PROPERTIES ${COALESCE_PYTEST_NO_SKIPS}
  ENVIRONMENT "COALESCE_SERVER=$<TARGET_FILE:coalesce-server>;COALESCE_MODELS_DIR=${COALESCE_MODELS_DIR}"
  TIMEOUT 600)

add_test(NAME hf_server_parity
         COMMAND ${COALESCE_PYTHON} -m pytest -q -p no:cacheprovider
                 ${CMAKE_CURRENT_SOURCE_DIR}/test_hf_server_parity.py)
set_tests_properties(hf_server_parity PROPERTIES ${COALESCE_PYTEST_NO_SKIPS}
  ENVIRONMENT "COALESCE_SERVER=$<TARGET_FILE:coalesce-server>;COALESCE_MODELS_DIR=${COALESCE_MODELS_DIR}"
  TIMEOUT 600)
