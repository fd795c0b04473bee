# Runs one command and checks its exit code, that stderr is exactly one line
# when the command fails, and regular expressions on stdout and stderr.
#   cmake -DCOMMAND="prog|arg|..." -DEXIT=N [-DSTDOUT=regex] [-DSTDERR=regex] -P expect_command.cmake
# Arguments are separated by | so that they survive add_test unchanged.
string(REPLACE "|" ";" command "${COMMAND}")
execute_process(COMMAND ${command} RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT code STREQUAL "${EXIT}")
  message(FATAL_ERROR "exit code ${code}, expected ${EXIT}\nstdout:\n${out}\nstderr:\n${err}")
endif()
if(NOT EXIT STREQUAL "0")
  string(REGEX MATCHALL "\n" newlines "${err}")
  list(LENGTH newlines line_count)
  if(NOT line_count EQUAL 1)
    message(FATAL_ERROR "stderr has ${line_count} lines, expected one:\n${err}")
  endif()
endif()
if(DEFINED STDOUT AND NOT out MATCHES "${STDOUT}")
  message(FATAL_ERROR "stdout does not match '${STDOUT}':\n${out}")
endif()
if(DEFINED STDERR AND NOT err MATCHES "${STDERR}")
  message(FATAL_ERROR "stderr does not match '${STDERR}':\n${err}")
endif()
